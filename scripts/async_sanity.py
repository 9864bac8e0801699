"""The seed's sanity check with the seed's trainer: TRL's AsyncGRPOTrainer (through
ParityAsyncGRPOTrainer) against a real vLLM server on this machine, SmolLM2-135M-Instruct,
reward -length on chat questions, AsyncGRPO's defaults (eps 0.2, lr 1e-6, max_staleness 4).

    python scripts/async_sanity.py --steps 3 --seeds 0 --out docs/reproduce/async-grpo

Starts one server per dtype (bf16, fp32, fp16; each stopped after its runs), runs
examples/trl_async_grpo.py for each recipe and seed (`--json`), and writes `runs.json`,
`claims.md` and per-step plots (length, |beta|, phantom share per recipe) into `--out`.

Each finished run is kept in `--out`/runs/ and reused by a later invocation with the same
settings, so the check can be run in parts (`--only`) and survives an interruption; a failed
run is tried again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parity import testbed
from parity.config import TASK_DEFAULTS
from parity.integrations.weight_sync import dev_server

ROOT = Path(__file__).resolve().parents[1]
# The seed's sanity check is parity's neg-length-chat task: its model and completion length.
TASK = TASK_DEFAULTS["neg-length-chat"]
# (server dtype, name in the tables, recipe, the example's extra flags, all seeds or the first)
PLAN = [("bf16", "bf16-engine", "bf16-engine", [], True),
        ("bf16", "bf16-shadow", "bf16-shadow", [], False),
        ("bf16", "bf16-shadow-scored", "bf16-shadow", ["--scored-shadow"], False),
        ("bf16", "wide-eps", "wide-eps", [], False), ("bf16", "no-clip", "no-clip", [], False),
        ("fp32", "fp32", "fp32", [], True), ("fp16", "fp16", "fp16", [], True)]
KEYS = ("completions/mean_length", "completions/clipped_ratio", "mismatch/beta_abs_mean",
        "mismatch/alpha_abs_mean", "clip/frac", "clip/phantom_frac", "clip/hidden_frac",
        "clip/alpha_frac", "mismatch/kl_k3", "staleness/mean", "perf/weight_sync_s",
        "sync/probe_gap_abs_mean", "time/shadow_s", "perf/step_s", "reward")
# What a run's numbers depend on: a kept run is reused only where these are the same.
SETTINGS = ("model", "steps", "batch", "group", "max_tokens", "server_cpus", "trainer_cpus")


def _settings(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in SETTINGS}


def _pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    return cmd if cpus is None else ["taskset", "-c", cpus, *cmd]


def planned(a: argparse.Namespace) -> list[tuple[str, str, str, list[str], int]]:
    """(server dtype, name, recipe, extra flags, seed) of every run, in plan order."""
    return [(d, name, recipe, extra, seed) for d, name, recipe, extra, every in PLAN
            for seed in (a.seeds if every else a.seeds[:1])]


def kept(a: argparse.Namespace, out: Path, name: str, seed: int) -> dict | None:
    """The run kept from an earlier invocation, if it finished with these settings."""
    f = out / "runs" / f"{name}-s{seed}.json"
    if not f.is_file():
        return None
    r = json.loads(f.read_text())
    return r if r.get("settings") == _settings(a) and "failed" not in r else None


def pending(a: argparse.Namespace, out: Path) -> list[tuple[str, str, str, list[str], int]]:
    """The planned runs this invocation runs: not kept, and named by --only if given."""
    return [j for j in planned(a) if kept(a, out, j[1], j[4]) is None
            and (not a.only or j[1] in a.only)]


def run_all(a: argparse.Namespace, model: Path, out: Path) -> list[dict]:
    """Runs what is pending, each kept in out/runs/ as it finishes; returns every planned run
    that has a kept result (failed ones included), in plan order."""
    kept_dir = out / "runs"
    kept_dir.mkdir(parents=True, exist_ok=True)
    plan, todo_all = planned(a), pending(a, out)
    runs: dict[tuple[str, int], dict] = {}
    for dtype in ("bf16", "fp32", "fp16"):
        jobs = [j for j in plan if j[0] == dtype]
        todo = [j for j in todo_all if j[0] == dtype]
        if todo:
            log = Path(tempfile.gettempdir()) / f"parity-async-server-{dtype}.log"
            with dev_server(model, dtype, log, cpus=a.server_cpus) as url:
                for _, name, recipe, extra, seed in todo:
                    r = _one(a, model, url, name, recipe, extra, seed, dtype, out)
                    (kept_dir / f"{name}-s{seed}.json").write_text(json.dumps(r, indent=1))
                    print(f"[async-sanity] {name} seed {seed}: "
                          + (f"failed: {r['failed']}" if "failed" in r else
                             f"{len(r['steps'])} steps in {r['wall_s'] / 60:.1f} min"),
                          flush=True)
        for _, name, _, _, seed in jobs:
            f = kept_dir / f"{name}-s{seed}.json"
            if f.is_file() and json.loads(f.read_text()).get("settings") == _settings(a):
                runs[(name, seed)] = json.loads(f.read_text())
    return [runs[(j[1], j[4])] for j in plan if (j[1], j[4]) in runs]


def _one(a: argparse.Namespace, model: Path, url: str, name: str, recipe: str,
         extra: list[str], seed: int, dtype: str, out: Path) -> dict:
    path = out / f".run-{name}-{seed}.json"
    cmd = [sys.executable, str(ROOT / "examples/trl_async_grpo.py"), "--model", str(model),
           "--server", url, "--recipe", recipe, *extra, "--seed", str(seed),
           "--steps", str(a.steps), "--batch", str(a.batch), "--group", str(a.group),
           "--max-tokens", str(a.max_tokens), "--json", str(path),
           "--out", str(Path(tempfile.gettempdir()) / "parity-async-trl")]
    t0 = time.time()
    p = subprocess.run(_pinned(a.trainer_cpus, cmd), capture_output=True, text=True)
    base = {"recipe": name, "seed": seed, "server": dtype, "settings": _settings(a)}
    if p.returncode != 0 or not path.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**base, "failed": tail[0], "wall_s": time.time() - t0}
    d = json.loads(path.read_text())
    path.unlink()
    return {**base, "wall_s": d["wall_s"], "steps": steps_of(d["log"]), "log": d["log"]}


def steps_of(log: list[dict]) -> list[dict]:
    """KEYS per optimizer step from TRL's log history, whose entries for one step may be
    several (TRL logs some metrics apart from the loss's)."""
    by: dict[int, dict] = {}
    for h in log:
        if "step" in h and ("clip/frac" in h or h["step"] in by):   # starts at its loss entry
            by.setdefault(h["step"], {}).update({k: v for k, v in h.items() if k in KEYS})
    return [{**{k: v.get(k) for k in KEYS}, "step": st} for st, v in sorted(by.items())]


# What the phantom share at sync would take on this model: live audits of a bf16 server at
# other temperatures and completion lengths (temperature, max tokens).
AUDITS = [(1.0, 64), (1.0, 256), (0.7, 64), (1.4, 64)]


def audit_dir(out: Path, t: float, n: int) -> Path:
    return out / "audits" / f"T{t:g}-L{n}"


def run_audits(a: argparse.Namespace, model: Path, out: Path) -> None:
    """`parity audit --server` against a bf16 server for each AUDITS setting not yet done."""
    todo = [(t, n) for t, n in AUDITS if not (audit_dir(out, t, n) / "audit.json").is_file()]
    if not todo:
        return
    log = Path(tempfile.gettempdir()) / "parity-async-server-audits.log"
    with dev_server(model, "bf16", log) as url:
        for t, n in todo:
            cmd = [sys.executable, "-m", "parity", "audit", "--server", url, "--model",
                   str(model), "--task", "neg-length-chat", "--samples", str(a.audit_samples),
                   "--max-new-tokens", str(n), "--temperature", str(t), "--no-progress",
                   "--out", str(audit_dir(out, t, n))]
            p = subprocess.run(cmd, capture_output=True, text=True)
            print(f"[async-sanity] audit T = {t:g}, ≤ {n} tokens: "
                  + ("done" if p.returncode == 0 else
                     "failed: " + ((p.stderr or p.stdout).strip().splitlines() or ["?"])[-1]),
                  flush=True)


def audit_rows(out: Path) -> list[dict]:
    """Per AUDITS setting: |β|, the share clipped at sync at ε = 0.2 (every clip there is
    numerical), the ε at which that share is the seeds' 18%; 'missing' where not audited."""
    from parity.experiments.reproduce import eps_at_share
    rows = []
    for t, n in AUDITS:
        f = audit_dir(out, t, n) / "audit.json"
        if not f.is_file():
            rows.append({"temperature": t, "max_tokens": n, "missing": True})
            continue
        d = json.loads(f.read_text())
        table = d["phantom_vs_eps"]
        at = {r["eps"]: r["clip_frac"] for r in table}
        rows.append({"temperature": t, "max_tokens": n, "completions": d["completions"],
                     "mean_len": d["tokens"] / d["completions"],
                     "beta_abs": d["metrics"]["mismatch/beta_abs_mean"],
                     "clip_0.2": at.get(0.2), "eps_18": eps_at_share(table, 0.18, "clip_frac")})
    return rows


def _audits_section(out: Path) -> list[str]:
    rows = audit_rows(out)
    if all(r.get("missing") for r in rows):
        return []
    md = ["", "## What an 18% phantom share would take: a bf16 server audited live",
          "", "`parity audit --server URL --task neg-length-chat` against a bf16 server of the "
          "same model (`--audits`), an fp32 rescoring. At sync every clipped token is clipped "
          "by numerics alone, so the share clipped is the phantom share the seed reports.", "",
          "| temperature | max tokens | completions | mean length | \\|β\\| | clipped at ε = 0.2 "
          "| ε where 18% are clipped |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("missing"):
            md.append(f"| {r['temperature']:g} | {r['max_tokens']} | missing |" + " |" * 4)
            continue
        eps = "never (at any ε audited)" if r["eps_18"] is None else f"{r['eps_18']:.2g}"
        clip = "missing" if r["clip_0.2"] is None else f"{100 * r['clip_0.2']:.2f}%"
        md.append(f"| {r['temperature']:g} | {r['max_tokens']} | {r['completions']} | "
                  f"{r['mean_len']:.1f} | {r['beta_abs']:.3g} | {clip} | {eps} |")
    return md


def _beside() -> list[str]:
    """parity's own trainer on the same task, model and engine (docs/reproduce/vllm/
    smollm2-135m), its claims beside these."""
    f = ROOT / "docs/reproduce/vllm/smollm2-135m/claims.json"
    if not f.is_file():
        return []
    d = json.loads(f.read_text())
    md = ["", "## parity's trainer on the same task, model and engine",
          "", "`parity reproduce --model smollm2-135m --engine vllm` "
          "([../vllm/smollm2-135m/claims.md](../vllm/smollm2-135m/claims.md)): vLLM's "
          "in-process engine, parity's trainer, the same reward, prompts, ε and lr.", "",
          "| claim | statement | measured | verdict |", "|---|---|---|---|"]
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    md += [f"| {c['id']} | {cell(c['statement'])} | {cell(c['reason'])} | **{c['verdict']}** |"
           for c in d["claims"]]
    return md


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x: float | None, f: str = ".3g") -> str:
    return "missing" if x is None else format(x, f)


def window(steps: int) -> int:
    """Steps averaged at each end of a run for its length drop: 8 completions a step are too
    few to compare one step with another."""
    return max(1, min(5, steps // 4))


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        if "failed" in r:
            rows.append({"recipe": r["recipe"], "seed": r["seed"], "failed": r["failed"]})
            continue
        st = r["steps"]
        w = window(len(st))

        def col(k: str, sl: slice, st: list = st) -> float | None:
            return _mean([s[k] for s in st[sl]])
        rows.append({"recipe": r["recipe"], "seed": r["seed"], "steps": len(st),
                     "length_first": col("completions/mean_length", slice(0, w)),
                     "length_last": col("completions/mean_length", slice(-w, None)),
                     "clip_first": col("clip/frac", slice(0, 1)),
                     "truncated": col("completions/clipped_ratio", slice(None)),
                     "beta_abs": col("mismatch/beta_abs_mean", slice(None)),
                     "clip": col("clip/frac", slice(None)),
                     "phantom": col("clip/phantom_frac", slice(None)),
                     "hidden": col("clip/hidden_frac", slice(None)),
                     "alpha_clip": col("clip/alpha_frac", slice(None)),
                     "probe_gap": col("sync/probe_gap_abs_mean", slice(None)),
                     "alpha_first": col("mismatch/alpha_abs_mean", slice(0, 1)),
                     "shadow_s": col("time/shadow_s", slice(None)),
                     "sync_s": col("perf/weight_sync_s", slice(None)),
                     "step_s": col("perf/step_s", slice(None)),
                     "wall_s": r["wall_s"]})
    return rows


def write(out: Path, a: argparse.Namespace, runs: list[dict], wall: float) -> None:
    rows = summary(runs)
    # TRL's whole log of each run stays in runs/, where a later invocation reuses it
    kept = [{k: v for k, v in r.items() if k != "log"} for r in runs]
    (out / "runs.json").write_text(json.dumps({"settings": vars(a), "wall_s": wall,
                                               "runs": kept, "summary": rows}, indent=1))
    head = ("| recipe | seed | steps | length first | length last | truncated | \\|β\\| | "
            "clip | phantom | hidden | α-clipped | probe gap | \\|α\\| step 1 | shadow s | "
            "sync s | step s |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['recipe']} | {r['seed']} | failed: {r['failed']} |" + " |" * 13)
            continue
        lines.append("| " + " | ".join([r["recipe"], str(r["seed"]), str(r["steps"])] + [
            _fmt(r[k]) for k in ("length_first", "length_last", "truncated", "beta_abs", "clip",
                                 "phantom", "hidden", "alpha_clip", "probe_gap", "alpha_first",
                                 "shadow_s", "sync_s", "step_s")]) + " |")
    cl = claims(rows, a.steps)
    md = ["# The seed's sanity check with TRL's AsyncGRPOTrainer against a vLLM server",
          "", f"`python scripts/async_sanity.py --steps {a.steps} --seeds "
          f"{' '.join(map(str, a.seeds))} --batch {a.batch} --group {a.group} --max-tokens "
          f"{a.max_tokens}" + "".join(f" --{k.replace('_', '-')} {getattr(a, k)}"
                                      for k in ("server_cpus", "trainer_cpus")
                                      if getattr(a, k, None) is not None)
          + f"`: {wall / 60:.1f} min of runs on this machine (2 CPU cores; each run's own "
          f"wall time, summed over the invocations that ran them). "
          f"{a.model}, reward −length on chat questions, {_trl_defaults()}, "
          f"an fp32 trainer except `fp16`. `runs.json` has every number; plots in `plots/`.",
          "", "| claim | statement | measured | verdict |", "|---|---|---|---|"]
    md += [f"| {c} | {st} | {m} | {v} |" for c, st, m, v in cl]
    md += ["", f"## Runs (means over the run's steps; length first/last: means over the first "
           f"and last {window(a.steps)} steps)",
           "", *lines]
    md += _audits_section(out) + _beside()
    (out / "claims.md").write_text("\n".join(md) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plots(out, runs)


def _trl_defaults() -> str:
    """AsyncGRPOConfig's own ε, learning rate and staleness, which every run keeps."""
    import dataclasses

    from trl.experimental.async_grpo import AsyncGRPOConfig
    d = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    return (f"ε = {d['epsilon']:g}, lr {d['learning_rate']:g}, max_staleness "
            f"{d['max_staleness']}")


def _by(rows: list[dict], recipe: str, key: str) -> list[float]:
    return [r[key] for r in rows if r["recipe"] == recipe and r.get(key) is not None]


def claims(rows: list[dict], steps: int) -> list[tuple[str, str, str, str]]:
    """(claim, statement, measured, verdict) from the runs' summary rows."""
    out = []
    drop = {k: [r["length_first"] - r["length_last"] for r in rows
                if r["recipe"] == k and r.get("length_first") is not None]
            for k in ("bf16-engine", "fp32", "fp16", "bf16-shadow", "bf16-shadow-scored",
                      "wide-eps", "no-clip")}
    enough = len(drop["bf16-engine"]) >= 3 and len(drop["fp32"]) >= 3 and steps >= 10
    measured = ", ".join(f"{k} {[round(x, 1) for x in v]}" for k, v in drop.items() if v)
    stalled = False
    if enough:
        import statistics
        diff = statistics.mean(drop["fp32"]) - statistics.mean(drop["bf16-engine"])
        se = (statistics.variance(drop["fp32"]) / len(drop["fp32"]) + statistics.variance(
            drop["bf16-engine"]) / len(drop["bf16-engine"])) ** 0.5
        stalled = diff > 2 * se
        verdict = "**holds**" if stalled else "**does not hold at this scale**"
        measured += f"; fp32 − bf16 drop {diff:.1f} ± {2 * se:.1f}"
    else:
        verdict = (f"**not measurable here** ({steps} steps, seeds per recipe "
                   f"{len(drop['bf16-engine'])}/{len(drop['fp32'])}: fewer than 10 steps and 3 "
                   f"seeds)")
    out.append(("A1", "a bf16 server stalls AsyncGRPO's fp32 trainer where an fp32 server "
                "trains (length drop over the run)", measured, verdict))
    first = _by(rows, "bf16-engine", "clip_first")
    if first:
        v = sum(first) / len(first)
        ph = _by(rows, "bf16-engine", "phantom")
        att = (f"; over all steps parity attributes {100 * sum(ph) / len(ph):.2f}% to "
               f"numerics alone (its shadow's kernels are not the server's)" if ph else "")
        out.append(("A2", "early in training ~18% of tokens are phantom-clipped (seed, "
                    "Qwen3-0.6B, ε = 0.2)",
                    f"{100 * v:.2f}% clipped at step 1, where nothing is stale and every clip "
                    f"is numerical (bf16-engine, mean of {len(first)} seeds){att}",
                    "**holds**" if 0.06 <= v <= 0.54 else "**does not hold at this scale**"))
    b16, b_fp16 = _by(rows, "bf16-engine", "beta_abs"), _by(rows, "fp16", "beta_abs")
    if b16 and b_fp16:
        r = (sum(b16) / len(b16)) / (sum(b_fp16) / len(b_fp16))
        out.append(("A3", "fp16 on both sides shrinks \\|β\\| against a bf16 server",
                    f"\\|β\\| {sum(b16) / len(b16):.3g} (bf16) vs {sum(b_fp16) / len(b_fp16):.3g} "
                    f"(fp16): {r:.1f}× smaller", "**holds**" if r > 2 else "**does not hold**"))
    gap = _by(rows, "bf16-engine", "probe_gap")
    if gap and b16:
        g, b = sum(gap) / len(gap), sum(b16) / len(b16)
        out.append(("A4", "against a real server the shadow's kernel gap is as large as β",
                    f"probe gap {g:.3g} per token vs \\|β\\| {b:.3g}",
                    "**holds**" if g >= 0.5 * b else "**does not hold**"))
    trainer_side = _by(rows, "bf16-shadow", "alpha_first")
    scored = _by(rows, "bf16-shadow-scored", "alpha_first")
    if trainer_side and scored:
        t, sc = sum(trainer_side) / len(trainer_side), sum(scored) / len(scored)
        cost = [_by(rows, k, "shadow_s") for k in ("bf16-shadow", "bf16-shadow-scored")]
        secs = " and ".join(f"{sum(c) / len(c):.2g} s" if c else "missing" for c in cost)
        out.append(("A6", "the server scoring the shadow removes its kernel gap (step 1: "
                    "nothing stale, \\|α\\| is the gap alone)",
                    f"\\|α\\| at step 1: {t:.3g} per token with the trainer's bf16 forward, "
                    f"{sc:.3g} scored by the server; shadow per loss call {secs}",
                    "**holds**" if sc < 0.1 * t else "**does not hold**"))
    out.append(("A5", "bf16-shadow, wide-eps and no-clip restore fp32's training",
                measured, "**not measurable here**: A1 measured no stall to restore"
                if not stalled else "compare their drops with fp32's and bf16-engine's"))
    return out


def plots(out: Path, runs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    (out / "plots").mkdir(exist_ok=True)
    for key, name in (("completions/mean_length", "length"),
                      ("mismatch/beta_abs_mean", "beta_abs"), ("clip/phantom_frac", "phantom")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in runs:
            if "steps" in r:
                ax.plot([s["step"] for s in r["steps"]], [s[key] for s in r["steps"]],
                        marker="o", label=f"{r['recipe']} s{r['seed']}")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"{name}.png", dpi=100)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TASK["model"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=TASK["max_new_tokens"])
    ap.add_argument("--out", default="docs/reproduce/async-grpo")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="run these plan entries only (names as in the tables); the others "
                         "already kept are still reported")
    ap.add_argument("--server-cpus", default=None,
                    help="cores for the vLLM server (taskset list, e.g. 1); default: all")
    ap.add_argument("--trainer-cpus", default=None,
                    help="cores for the trainer (e.g. 0); default: all")
    ap.add_argument("--audits", action="store_true",
                    help="also audit a bf16 server at other temperatures and lengths "
                         "(what an 18%% phantom share would take)")
    ap.add_argument("--audit-samples", type=int, default=64)
    ap.add_argument("--rewrite", action="store_true",
                    help="rebuild claims, table and plots from --out's runs.json, running nothing")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.rewrite:
        saved = json.loads((out / "runs.json").read_text())
        a = argparse.Namespace(**{**saved["settings"], "out": a.out, "rewrite": True})
        write(out, a, saved["runs"], saved["wall_s"])
    else:
        model = testbed.resolve_model(a.model)
        if a.audits:
            run_audits(a, model, out)
        runs = run_all(a, model, out)
        write(out, a, runs, sum(r["wall_s"] for r in runs))
    print((out / "claims.md").read_text())
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
