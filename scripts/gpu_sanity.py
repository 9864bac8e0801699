"""The seed's sanity check on one GPU: every recipe and seed at once, each its own `parity train`
process beside the others, stopped at a deadline, then judged as `parity reproduce --model`
judges its runs (claims R4, R5s, R6 and R7, parity/experiments/claims_real.py).

    python scripts/gpu_sanity.py --out sanity --deadline-s 540
    python scripts/gpu_sanity.py --judge-only sanity
    python scripts/gpu_sanity.py --model text-xs --task neg-length --device cpu --steps 4 \\
        --prompts 2 --group 2 --max-new-tokens 8 --seeds 0 1 --out /tmp/sanity-rehearsal

Runs fp32, bf16-engine, fp16 and bf16-shadow-scored (bf16-shadow with the shadow the engine
scores itself) for each seed: neg-length-chat on SmolLM2-135M-Instruct with vLLM, ε = 0.2,
lr 1e-6. Each run writes `--out`/RECIPE-sSEED/ and its output to `--out`/RECIPE-sSEED.log; one
line per run as it starts and ends, and the steps each has done every `--progress-s`.

At `--deadline-s` (counted from the first run's start) every run still going gets SIGINT:
parity abandons the step in progress, keeps every finished one in metrics.jsonl and exits 130.
A run that records another step after it has lost the interrupt and gets SIGINT again; one
still alive `--grace-s` later gets SIGKILL (its finished steps are on disk all the same).
SIGINT or SIGTERM to this script stops its runs the same way, then judges what they did. Set
the deadline so that the grace and the judging (about ten seconds) still fit the time the
machine is lent for.

The judge truncates every run to the fewest steps any run of at least `--window` steps reached
(the others are dropped, and said so; by default a tenth of the steps the longest run reached,
at least 3), and writes `runs.json`, `claims.md` and `plots/`.
Each run's checkpoint is removed once it ends: the judge reads metrics.jsonl only, and `--out`
stays small enough to bring back from the machine.

On the GPU every run holds its own model, optimizer and vLLM engine: parity's memory estimate
(parity/runs/memory.py) for one of these runs is about 37 GB with the whole step's 128
completions in one forward, 5.5 GB with `--micro-batch 8` (the default here), so twelve fit on
an H200's 139 GB beside their engines; `--vllm-gpu-memory` is vLLM's start-up check only (its
KV cache is sized to the batch, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from parity import metric_names as mn
from parity.cli import markdown_table
from parity.errors import ParityError
from parity.experiments import claims as C
from parity.experiments import claims_real as CR
from parity.experiments.reproduce_real import PANELS, run_stats
from parity.reports import load_metrics, sweep_report

# The plan's names for what each run trains; another name is passed as `--recipe NAME`.
RECIPES = {"fp32": ["--recipe", "fp32"], "bf16-engine": ["--recipe", "bf16-engine"],
           "fp16": ["--recipe", "fp16"],
           "bf16-shadow-scored": ["--recipe", "bf16-shadow", "--shadow-kernels", "scored"]}
MIN_WINDOW = 3


def _say(msg: str) -> None:
    print(f"[gpu-sanity] {msg}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="neg-length-chat")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--eps", type=float, default=0.2, help="clip range, both sides")
    ap.add_argument("--vllm-gpu-memory", type=float, default=0.05)
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="completions per forward (0: the whole step's at once)")
    ap.add_argument("--vllm-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM decodes by replaying CUDA graphs, parity's default on a GPU "
                    "(--no-vllm-cuda-graphs: eager)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads per run (0: the cores shared out among the runs)")
    ap.add_argument("--out", default="gpu-sanity")
    ap.add_argument("--stagger-s", type=float, default=2.0,
                    help="seconds between starts, so that vLLM's start-up checks do not race")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="stop every run this many seconds after the start (0: none)")
    ap.add_argument("--grace-s", type=float, default=20.0,
                    help="seconds from the deadline's SIGINT to SIGKILL")
    ap.add_argument("--progress-s", type=float, default=30.0)
    ap.add_argument("--window", type=int, default=None,
                    help="steps averaged at each end of a run, and the least a run needs to be "
                         "judged (default: max(3, steps // 10), of the steps the longest run "
                         "reached)")
    ap.add_argument("--judge-only", metavar="DIR", default=None,
                    help="judge the runs already in DIR, running nothing")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- running

class Run:
    def __init__(self, recipe: str, seed: int, out: Path):
        self.recipe, self.seed = recipe, seed
        self.name = f"{recipe}-s{seed}"
        self.dir, self.log = out / self.name, out / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.t0 = self.wall_s = self.rc = None
        self.stopped = False            # by the deadline (or a signal to this script)
        self.steps_at_sigint = 0

    def steps(self) -> int:
        f = self.dir / "metrics.jsonl"
        return f.read_bytes().count(b"\n") if f.is_file() else 0

    def record(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "seed": self.seed, "rc": self.rc, "wall_s": self.wall_s,
                "stopped": self.stopped, "started": self.t0 is not None}


def command(a: argparse.Namespace, run: Run, threads: int) -> list[str]:
    return [sys.executable, "-m", "parity", "train", "--task", a.task, "--model", a.model,
            "--engine", a.engine, "--device", a.device,
            *RECIPES.get(run.recipe, ["--recipe", run.recipe]), "--seed", str(run.seed),
            "--steps", str(a.steps), "--lr", str(a.lr), "--eps-low", str(a.eps),
            "--eps-high", str(a.eps), "--prompts-per-step", str(a.prompts),
            "--samples-per-prompt", str(a.group), "--max-new-tokens", str(a.max_new_tokens),
            "--vllm-gpu-memory", str(a.vllm_gpu_memory), "--micro-batch", str(a.micro_batch),
            "--threads", str(threads), "--out", str(run.dir), "--no-progress",
            "--save-every", "0", "--report-to", "none",
            "--vllm-cuda-graphs" if a.vllm_cuda_graphs else "--no-vllm-cuda-graphs"]


def _child() -> None:
    # A shell without job control starts a background command with SIGINT ignored, and a
    # child inherits that: the deadline's SIGINT would do nothing and every run would be killed.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # If this script dies (a time limit around it), its runs stop as at the deadline.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)   # 1: PR_SET_PDEATHSIG


def _write_launch(out: Path, argv: list[str], a: argparse.Namespace, runs: list[Run]) -> None:
    (out / "launch.json").write_text(json.dumps(
        {"command": argv, "args": vars(a), "runs": [r.record() for r in runs]}, indent=1))


def _ended(run: Run, deadline_passed: bool) -> None:
    run.rc, run.wall_s = run.proc.returncode, time.monotonic() - run.t0
    _say(f"end {run.name}: rc {run.rc}, {run.steps()} steps, {run.wall_s:.0f} s")
    if run.rc != 0 and not (run.stopped and deadline_passed):
        lines = [x for x in run.log.read_text(errors="replace").splitlines() if x.strip()]
        _say(f"  {run.name} failed: {lines[-1] if lines else 'no output'} (see {run.log})")
    # The judge reads metrics.jsonl only; a checkpoint is 1.6 GB on SmolLM2-135M.
    shutil.rmtree(run.dir / "checkpoints", ignore_errors=True)


def _interrupt(run: Run) -> None:
    # A KeyboardInterrupt raised inside a __del__ is printed and dropped ("Exception ignored
    # in"; vLLM's CPU GEMM handler's, in the rehearsal), and the run trains on: a run that still
    # records steps is interrupted again.
    run.steps_at_sigint = run.steps()
    os.kill(run.proc.pid, signal.SIGINT)


def _signal_group(run: Run, sig: int) -> None:
    try:
        os.killpg(run.proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop(going: list[Run], since: float, grace: float, now: bool) -> bool:
    """From the deadline on: SIGINT to every run, again to one that still records steps, and
    SIGKILL once `grace` seconds have passed `since` it (or `now`). True once killed."""
    for r in going:
        if not r.stopped:
            r.stopped = True
            _interrupt(r)
        elif r.steps() > r.steps_at_sigint:
            _say(f"SIGINT again to {r.name}: it recorded step {r.steps()} after the last one")
            _interrupt(r)
    if since < grace and not now:
        return False
    for r in going:
        _say(f"SIGKILL to {r.name}: still running {since:.0f} s after SIGINT")
        _signal_group(r, signal.SIGKILL)
    return True


def launch(a: argparse.Namespace, argv: list[str]) -> list[Run]:
    """Starts every run, staggered; stops those still going at the deadline; returns them all
    once every one has ended."""
    out = Path(a.out)
    runs = [Run(r, s, out) for s in a.seeds for r in a.recipes]
    taken = [r.name for r in runs if r.dir.exists() and any(r.dir.iterdir())]
    if taken:
        raise SystemExit(f"gpu_sanity: {out} already holds {', '.join(taken)}: choose another "
                         f"--out, or judge them with --judge-only {out}")
    out.mkdir(parents=True, exist_ok=True)
    from parity import testbed
    testbed.resolve_model(a.model)   # a conversion once, here, not twelve racing ones
    threads = a.threads or max(1, (os.cpu_count() or 1) // len(runs))
    _write_launch(out, argv, a, runs)
    asked: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, frame: asked.append(signum))
              for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    deadline = t0 + a.deadline_s if a.deadline_s > 0 else math.inf
    todo, going = list(runs), []
    next_start, next_report, stop_at, killed = t0, t0 + a.progress_s, None, False
    while todo or going:
        now = time.monotonic()
        if stop_at is None and (now >= deadline or asked):
            stop_at = now
            why = "deadline" if now >= deadline else f"signal {asked[0]}"
            _say(f"{why} at {now - t0:.0f} s: SIGINT to {len(going)} runs"
                 + (f", {len(todo)} never started" if todo else ""))
            todo.clear()
        if stop_at is not None and not killed:
            killed = _stop(going, now - stop_at, a.grace_s, len(asked) > 1)
        if todo and now >= next_start:
            r = todo.pop(0)
            with open(r.log, "w") as log:
                r.proc = subprocess.Popen(command(a, r, threads), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_child)
            r.t0, next_start = time.monotonic(), now + a.stagger_s
            going.append(r)
            _say(f"start {r.name} (pid {r.proc.pid}) at {r.t0 - t0:.0f} s")
        for r in [r for r in going if r.proc.poll() is not None]:
            going.remove(r)
            _ended(r, stop_at is not None)
            _signal_group(r, signal.SIGKILL)    # anything it left behind in its group
            _write_launch(out, argv, a, runs)
        if now >= next_report and going:
            next_report = now + a.progress_s
            _say(f"{now - t0:.0f} s, steps: "
                 + ", ".join(f"{r.name} {r.steps()}" for r in runs if r.t0 is not None))
        time.sleep(0.2)
    for sig, handler in before.items():
        signal.signal(sig, handler)
    _write_launch(out, argv, a, runs)
    return runs


# ----------------------------------------------------------------------------- judging

def steps_recorded(run_dir: Path) -> tuple[int, str | None]:
    """Whole steps in a run's metrics.jsonl, and why there are none."""
    try:
        return len(load_metrics(run_dir / "metrics.jsonl")), None
    except ParityError as e:
        return 0, str(e)


def common_steps(counts: dict[str, int], least: int) -> tuple[int | None, dict[str, str]]:
    """The fewest steps among the runs that have at least `least`, and why each other run is
    dropped."""
    kept = [n for n, c in counts.items() if c >= least]
    dropped = {n: f"{c} steps, fewer than the {least} a run needs" for n, c in counts.items()
               if c < least}
    return (min(counts[n] for n in kept) if kept else None), dropped


def window_for(reached: int, common: int | None, window: int | None) -> tuple[int, int]:
    """(the least steps a run needs to be judged, the window averaged at each end), where the
    longest run reached `reached` steps and the judged ones `common`. By default a tenth of
    `reached`: a deadline that cut every run short leaves a tenth of the steps asked out of
    reach. The window shrinks to half of `common`, so that the first and the last steps of a
    run do not overlap."""
    least = window or max(MIN_WINDOW, reached // 10)
    return least, least if common is None else min(least, max(1, common // 2))


def means(run_dir: Path, steps: int) -> dict[str, float | None]:
    """The run's clipped and phantom-clipped token shares, over its first `steps` steps."""
    rows = load_metrics(run_dir / "metrics.jsonl")[:steps]
    out = {}
    for key, name in ((mn.CLIP_FRAC, "clip_mean"), (mn.PHANTOM_FRAC, "phantom_mean")):
        v = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        out[name] = statistics.fmean(v) if v else None
    return out


def drops_of(runs: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in runs:
        if r.get("stats") and r["stats"]["drop"] is not None:
            out.setdefault(r["recipe"], []).append(r["stats"]["drop"])
    return out


def claims_of(runs: list[dict], lr: float, steps: int) -> list[C.Claim]:
    """R4, R5s, R6 and R7 from the judged runs, as reproduce_real.judge reads them."""
    drops = drops_of(runs)
    bf = [r["stats"] for r in runs if r["recipe"] == "bf16-engine" and r.get("stats")]
    bf = [s for s in bf if s["kl_last"] is not None]
    return [CR.sanity_check(drops, lr, steps), CR.scored_shadow_like_fp32(drops),
            CR.fp16_like_fp32(drops),
            CR.gap_grows([s["kl_first"] for s in bf], [s["kl_last"] for s in bf],
                         "KL(μ‖π) (k3)", "R7")]


def spread(drops: dict[str, list[float]]) -> dict[str, Any]:
    """Each recipe's mean drop and its standard deviation over seeds, and whether the seeds'
    spread is smaller than fp32's lead over bf16-engine."""
    per = {r: {"drops": v, "mean": statistics.fmean(v),
               "sd": statistics.stdev(v) if len(v) > 1 else None} for r, v in drops.items()}
    sds = {r: p["sd"] for r, p in per.items() if p["sd"] is not None}
    gap = (per["fp32"]["mean"] - per["bf16-engine"]["mean"]
           if "fp32" in per and "bf16-engine" in per else None)
    widest = max(sds, key=sds.get) if sds else None
    smaller = None if widest is None or gap is None else sds[widest] < abs(gap)
    if smaller is None:
        text = ("the seeds' spread and the fp32 − bf16-engine difference cannot be compared: "
                "fp32 or bf16-engine has no finished run, or no recipe has two seeds")
    else:
        text = (f"the seeds' spread (the largest standard deviation of a recipe's drop: "
                f"{sds[widest]:.2f} tokens, {widest}) is {'' if smaller else 'not '}smaller "
                f"than the fp32 − bf16-engine difference of the mean drops ({gap:+.2f} tokens)")
    return {"recipes": per, "fp32_minus_bf16_engine": gap,
            "largest_sd": None if widest is None else sds[widest],
            "spread_smaller_than_difference": smaller, "text": text}


def judge(out: Path, window: int | None = None, judged_by: list[str] | None = None
          ) -> dict[str, Any]:
    """Judges the runs `launch` left in `out`: runs.json, claims.md and plots/ there."""
    f = out / "launch.json"
    if not f.is_file():
        raise SystemExit(f"gpu_sanity: {f} not found: --judge-only reads a directory this "
                         f"script ran")
    launch = json.loads(f.read_text())
    a = launch["args"]
    runs = launch["runs"]
    counts, why_none = {}, {}
    for r in runs:
        name = f"{r['recipe']}-s{r['seed']}"
        counts[name], why_none[name] = steps_recorded(out / name)
    reached = min(a["steps"], max(counts.values(), default=0))
    least, _ = window_for(reached, None, window)
    common, dropped = common_steps(counts, least)
    _, win = window_for(reached, common, window)
    for r in runs:
        name = f"{r['recipe']}-s{r['seed']}"
        r["steps"] = counts[name]
        if name in dropped:
            r["dropped"] = ("never started: the deadline came first" if not r["started"] else
                            f"no step recorded (rc {r['rc']}): {why_none[name]}"
                            if counts[name] == 0 else f"{dropped[name]} (rc {r['rc']})")
            continue
        r["stats"] = run_stats(out / name, win, common) | means(out / name, common)
    workload = {"model": a["model"], "task": a["task"], "engine": a["engine"],
                "device": a["device"], "prompts_per_step": a["prompts"],
                "samples_per_prompt": a["group"], "completions_per_step": a["prompts"] * a["group"],
                "max_new_tokens": a["max_new_tokens"], "lr": a["lr"], "eps": a["eps"],
                "micro_batch": a["micro_batch"], "steps_asked": a["steps"],
                "steps_longest_run": reached, "steps_reached": common, "window": win,
                "least_steps": least,
                "runs_at_once": len(runs), "deadline_s": a["deadline_s"]}
    claims = claims_of(runs, a["lr"], common or 0)
    result = {"command": launch["command"], "judged_by": judged_by, "workload": workload,
              "runs": runs, "spread": spread(drops_of(runs)),
              "claims": [c.to_dict() for c in claims]}
    (out / "runs.json").write_text(json.dumps(result, indent=1, default=str))
    plotted = plot(out, runs)
    (out / "claims.md").write_text(markdown(result, claims, plotted))
    return result


def _cmd(argv: list[str]) -> str:
    return "python " + " ".join(shlex.quote(x) for x in argv)


def _g(v: Any, fmt: str) -> str:
    return "missing" if v is None else format(v, fmt)


def markdown(result: dict[str, Any], claims: list[C.Claim], plotted: bool) -> str:
    w, runs = result["workload"], result["runs"]
    judged = (f" (judged by `{_cmd(result['judged_by'])}`)" if result["judged_by"] else "")
    reached = (f"every run judged reached {w['steps_reached']} and is truncated to them"
               if w["steps_reached"] else "no run reached enough to be judged")
    pre = (f"`{_cmd(result['command'])}`{judged}: {w['runs_at_once']} `parity train` processes "
           f"at once on one {w['device']} device"
           + (f", stopped at {w['deadline_s']:g} s" if w["deadline_s"] else "") + ". "
           f"{w['model']}, task {w['task']}, engine {w['engine']}, {w['prompts_per_step']} "
           f"prompts × {w['samples_per_prompt']} completions = {w['completions_per_step']} per "
           f"step, at most {w['max_new_tokens']} new tokens, lr {w['lr']:g}, ε = {w['eps']:g}, "
           f"{w['steps_asked']} steps asked: {reached}; a run's drop is its mean length over "
           f"its first {w['window']} steps minus over its last {w['window']}. Runs with fewer "
           f"than {w['least_steps']} steps are dropped. `runs.json` has every number.")
    md = C.to_markdown(claims, "The seed's sanity check, every run at once on one device", pre)
    per = result["spread"]["recipes"]
    md += "\n## Seed spread (length drop, tokens)\n\n" + (markdown_table(
        ["recipe", "drop per seed", "mean", "SD"],
        [[r, ", ".join(f"{x:.2f}" for x in p["drops"]), f"{p['mean']:.2f}", _g(p["sd"], ".2f")]
         for r, p in per.items()]) if per else "No run was judged.\n")
    md += f"\nOver the seeds: {result['spread']['text']}.\n"
    rows = []
    for r in runs:
        s = r.get("stats")
        if s is None:
            continue
        rows.append([r["recipe"], str(r["seed"]), str(r["rc"]), str(s["steps"]),
                     _g(s["len_first"], ".1f"), _g(s["len_last"], ".1f"), _g(s["drop"], "+.1f"),
                     _g(s["truncated_first"], ".0%"), _g(s["beta_first"], ".3g"),
                     _g(s["beta_last"], ".3g"), _g(s["clip_mean"], ".3g"),
                     _g(s["phantom_mean"], ".3g"), _g(s["kl_first"], ".2g"),
                     _g(s["kl_last"], ".2g"), _g(s["step_s"], ".1f"), _g(r["wall_s"], ".0f")])
    md += "\n## Runs\n\n" + (markdown_table(
        ["recipe", "seed", "rc", "steps", "length first", "length last", "drop",
         "truncated first", "|β| first", "|β| last", "clip", "phantom", "KL first", "KL last",
         "step s", "wall s"], rows) if rows else "No run was judged.\n")
    md += (f"\nLength, truncated, |β| last and KL last: means over the first or last "
           f"{w['window']} steps; |β| and KL first: step 1; clip and phantom: shares of tokens, "
           f"means over the steps judged. rc 130: stopped by SIGINT at the deadline; -9: "
           f"killed after the grace that followed it.\n")
    dropped = [f"{r['recipe']}-s{r['seed']}: {r['dropped']}" for r in runs if "dropped" in r]
    if dropped:
        md += "\nDropped: " + "; ".join(dropped) + ".\n"
    if plotted:
        md += ("\n![each panel a metric against step, a line per recipe over its seeds]"
               "(plots/sweep.png)\n")
    return md


def plot(out: Path, runs: list[dict]) -> bool:
    """plots/sweep.png and plots/report.html: the reproduction's panels (completion length,
    EOS, |β|, KL, phantom clipping, weights changed at sync), a line per recipe over its seeds."""
    groups: dict[str, list[Path]] = {}
    for r in runs:
        if r.get("stats"):
            groups.setdefault(r["recipe"], []).append(out / f"{r['recipe']}-s{r['seed']}")
    if groups:
        sweep_report(groups, out / "plots", PANELS)
    return bool(groups)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    a = parse(argv[1:])
    if a.judge_only:
        out = Path(a.judge_only)
        judge(out, a.window, judged_by=argv)
    else:
        out = Path(a.out)
        launch(a, argv)
        judge(out, a.window)
    print((out / "claims.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
