"""The seed's sanity check with the seed's trainer: TRL's AsyncGRPOTrainer (through
ParityAsyncGRPOTrainer) against a real vLLM server on this machine, SmolLM2-135M-Instruct,
reward -length on chat questions, AsyncGRPO's defaults (eps 0.2, lr 1e-6, max_staleness 4).

    python scripts/async_sanity.py --steps 3 --seeds 0 --out docs/reproduce/async-grpo

Starts one server per dtype (bf16, fp32, fp16; each stopped after its runs), runs
examples/trl_async_grpo.py for each recipe and seed (`--json`), and writes `runs.json`,
`claims.md` and per-step plots (length, |beta|, phantom share per recipe) into `--out`.
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
# (server dtype, recipe, all seeds or the first only)
PLAN = [("bf16", "bf16-engine", True), ("bf16", "bf16-shadow", False),
        ("bf16", "wide-eps", False), ("bf16", "no-clip", False),
        ("fp32", "fp32", True), ("fp16", "fp16", True)]
KEYS = ("completions/mean_length", "completions/clipped_ratio", "mismatch/beta_abs_mean",
        "clip/frac", "clip/phantom_frac", "clip/hidden_frac", "clip/alpha_frac",
        "mismatch/kl_k3", "staleness/mean", "perf/weight_sync_s", "sync/probe_gap_abs_mean",
        "perf/step_s", "reward")


def run_all(a: argparse.Namespace, model: Path, out: Path) -> list[dict]:
    runs = []
    for dtype in ("bf16", "fp32", "fp16"):
        jobs = [(r, s) for d, r, every in PLAN if d == dtype
                for s in (a.seeds if every else a.seeds[:1])]
        if not jobs:
            continue
        log = Path(tempfile.gettempdir()) / f"parity-async-server-{dtype}.log"
        with dev_server(model, dtype, log) as url:
            for recipe, seed in jobs:
                path = out / f"run-{recipe}-{seed}.json"
                cmd = [sys.executable, str(ROOT / "examples/trl_async_grpo.py"), "--model",
                       str(model), "--server", url, "--recipe", recipe, "--seed", str(seed),
                       "--steps", str(a.steps), "--batch", str(a.batch), "--group",
                       str(a.group), "--max-tokens", str(a.max_tokens), "--json", str(path),
                       "--out", str(Path(tempfile.gettempdir()) / "parity-async-trl")]
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0 or not path.exists():
                    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
                    runs.append({"recipe": recipe, "seed": seed, "server": dtype,
                                 "failed": tail[0], "wall_s": time.time() - t0})
                    continue
                d = json.loads(path.read_text())
                steps = [{k: h.get(k) for k in (*KEYS, "step")}
                         for h in d["log"] if "clip/frac" in h]
                runs.append({"recipe": recipe, "seed": seed, "server": dtype,
                             "wall_s": d["wall_s"], "steps": steps})
                path.unlink()
    return runs


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x: float | None, f: str = ".3g") -> str:
    return "missing" if x is None else format(x, f)


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        if "failed" in r:
            rows.append({"recipe": r["recipe"], "seed": r["seed"], "failed": r["failed"]})
            continue
        st = r["steps"]

        def col(k: str, sl: slice, st: list = st) -> float | None:
            return _mean([s[k] for s in st[sl]])
        rows.append({"recipe": r["recipe"], "seed": r["seed"], "steps": len(st),
                     "length_first": col("completions/mean_length", slice(0, 1)),
                     "length_last": col("completions/mean_length", slice(-1, None)),
                     "truncated": col("completions/clipped_ratio", slice(None)),
                     "beta_abs": col("mismatch/beta_abs_mean", slice(None)),
                     "clip": col("clip/frac", slice(None)),
                     "phantom": col("clip/phantom_frac", slice(None)),
                     "hidden": col("clip/hidden_frac", slice(None)),
                     "alpha_clip": col("clip/alpha_frac", slice(None)),
                     "probe_gap": col("sync/probe_gap_abs_mean", slice(None)),
                     "sync_s": col("perf/weight_sync_s", slice(None)),
                     "step_s": col("perf/step_s", slice(None)),
                     "wall_s": r["wall_s"]})
    return rows


def write(out: Path, a: argparse.Namespace, runs: list[dict], wall: float) -> None:
    rows = summary(runs)
    (out / "runs.json").write_text(json.dumps({"settings": vars(a), "wall_s": wall,
                                               "runs": runs, "summary": rows}, indent=1))
    head = ("| recipe | seed | steps | length first | length last | truncated | \\|β\\| | "
            "clip | phantom | hidden | α-clipped | probe gap | sync s | step s |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['recipe']} | {r['seed']} | failed: {r['failed']} |" + " |" * 11)
            continue
        lines.append("| " + " | ".join([r["recipe"], str(r["seed"]), str(r["steps"])] + [
            _fmt(r[k]) for k in ("length_first", "length_last", "truncated", "beta_abs", "clip",
                                 "phantom", "hidden", "alpha_clip", "probe_gap", "sync_s",
                                 "step_s")]) + " |")
    cl = claims(rows, a.steps)
    md = ["# The seed's sanity check with TRL's AsyncGRPOTrainer against a vLLM server",
          "", f"`python scripts/async_sanity.py --steps {a.steps} --seeds "
          f"{' '.join(map(str, a.seeds))} --batch {a.batch} --group {a.group} --max-tokens "
          f"{a.max_tokens}`: {wall / 60:.1f} min on this machine (2 CPU cores, shared). "
          f"{a.model}, reward −length on chat questions, {_trl_defaults()}, "
          f"an fp32 trainer except `fp16`. `runs.json` has every number; plots in `plots/`.",
          "", "| claim | statement | measured | verdict |", "|---|---|---|---|"]
    md += [f"| {c} | {st} | {m} | {v} |" for c, st, m, v in cl]
    md += ["", "## Runs (means over the run's steps; length first/last: first and last step)",
           "", *lines]
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
            for k in ("bf16-engine", "fp32", "fp16", "bf16-shadow", "wide-eps", "no-clip")}
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
    ph = _by(rows, "bf16-engine", "phantom")
    if ph:
        v = sum(ph) / len(ph)
        out.append(("A2", "early in training ~18% of tokens are phantom-clipped (seed, "
                    "Qwen3-0.6B, ε = 0.2)", f"{100 * v:.2f}% (bf16-engine, steps 1..{steps})",
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
        runs = run_all(a, testbed.resolve_model(a.model), out)
        write(out, a, runs, time.time() - t0)
    print((out / "claims.md").read_text())
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
