"""`parity sweep`: a grid of runs (recipes × seeds × tasks × models) into one directory.

    DIR/runs/<task>-<model>-<recipe>-s<seed>/   one ordinary run directory each
    DIR/summary.json                            per run and per recipe (over seeds)
    DIR/report.html + PNGs                      one line per recipe, a band over its seeds

Runs go to worker processes (as many as the cores allow at `threads` each). A finished run is
skipped when the sweep is run again; an unfinished one (a crash, Ctrl-C) is moved aside to
`<name>.incomplete-N` and started afresh, so nothing is lost and nothing is mixed.

A sweep may continue another's runs (`continue_from`): each run starts as a copy of the
same-named run there and trains on, as `parity train --resume RUN --steps N` would, to this
grid's `steps`. The copy leaves the earlier sweep as it was.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import active_children, get_context
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from parity import metric_names as mn
from parity import ui
from parity.config import Config, dump_yaml, make_config
from parity.errors import ParityError
from parity.files import ensure_writable
from parity.reports import load_metrics, sweep_report
from parity.runs import checkpoints
from parity.runs.dirs import lock_dir, metrics_lines, refuse_other_output
from parity.runs.model import load_model_and_task
from parity.trainer import train

# When a run counts as converged: (metric, "<=" or ">=", value), on a trailing mean over WINDOW
# steps so a single lucky batch does not count.
THRESHOLDS: dict[str, tuple[str, str, float]] = {
    "neg-length": (mn.LEN_MEAN, "<=", 2.0),
    "neg-length-chat": (mn.LEN_MEAN, "<=", 2.0),
    "arith": (mn.REWARD_MEAN, ">=", 0.9),
}
WINDOW = 5
EARLY = 5  # "early in training": the first steps, before the policy has moved far
# Mismatch figures each run's summary gives over its first and its last EARLY steps.
MISMATCH_OVER_TRAINING = (("kl_exact", mn.KL_EXACT), ("kl_k3", mn.KL_K3),
                          ("beta_abs", mn.BETA_ABS_MEAN))


@dataclass(kw_only=True)
class SweepSpec:
    recipes: list[str]
    seeds: list[int] = field(default_factory=lambda: [0])
    tasks: list[str] = field(default_factory=lambda: [Config.task])
    models: list[str | None] = field(default_factory=lambda: [None])
    overrides: dict[str, Any] = field(default_factory=dict)   # any Config field, for every run
    per_recipe: dict[str, dict[str, Any]] = field(default_factory=dict)  # ... for one recipe
    workers: int = 0          # 0: as many as the cores allow at `threads` each
    threads: int = 1
    continue_from: Path | None = None   # a sweep directory whose same-named runs these continue


@dataclass
class RunSpec:
    name: str
    group: str                # the recipe's line in the report: task, model, recipe
    explicit: dict[str, Any]
    path: Path


def plan(spec: SweepSpec, out: Path) -> list[RunSpec]:
    """Every run of the grid, with its config checked now: a bad grid fails before any run."""
    if not spec.recipes or not spec.seeds:
        raise ParityError("sweep: give at least one recipe and one seed")
    runs = []
    for task in spec.tasks:
        for model in spec.models:
            for recipe in spec.recipes:
                for seed in spec.seeds:
                    mname = Path(model).name if model else "default"
                    group = f"{Path(task).stem}-{mname}-{recipe}"
                    name = f"{group}-s{seed}"
                    explicit = {**spec.overrides, **spec.per_recipe.get(recipe, {}),
                                "task": task, "recipe": recipe, "seed": seed,
                                "out": str(out / "runs" / name), "progress": False,
                                "threads": spec.threads}
                    if model:
                        explicit["model"] = model
                    make_config(dict(explicit))  # raises ParityError on a bad combination
                    runs.append(RunSpec(name, group, explicit, out / "runs" / name))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ParityError("sweep: two runs of the grid would share a directory (repeated "
                          "recipe, seed, task or model)")
    return runs


def finished(run: RunSpec) -> bool:
    """A run is finished when its last step is logged and its final checkpoint is in place."""
    steps = make_config(dict(run.explicit)).steps
    metrics = run.path / "metrics.jsonl"
    if not (run.path / "checkpoints" / f"step-{steps}").is_dir() or not metrics.is_file():
        return False
    try:
        lines = metrics_lines(metrics)
    except ParityError:
        return False
    # A line that cannot be read (damaged, or cut by a kill) means not finished: the run is set
    # aside and run again, and its summary is never made of part of its steps.
    return bool(lines) and all(x.row is not None for x in lines) and \
        lines[-1].row[mn.STEP] == steps  # type: ignore[index]


def _set_aside(path: Path) -> Path:
    n = 1
    while (dest := path.with_name(f"{path.name}.incomplete-{n}")).exists():
        n += 1
    path.rename(dest)
    return dest


def _copy_earlier(run: RunSpec, earlier: Path) -> bool:
    """Start `run` as a copy of the same-named run of the sweep in `earlier`, to be resumed;
    False where that run has no checkpoint to go on from (the run then starts afresh)."""
    src = earlier / "runs" / run.name
    if not src.is_dir() or checkpoints.latest_valid(src) is None:
        return False
    shutil.copytree(src, run.path)
    # The run's config is this grid's (a longer budget), as a resumed run's is
    dump_yaml(make_config(dict(run.explicit)), run.path / "config.yaml")
    return True


def _run_one(explicit: dict[str, Any], resume: bool = False) -> dict[str, Any]:
    """Worker: one training run (`resume`: continue the run already in its directory). Errors
    come back as text; the sweep goes on."""

    t0 = time.perf_counter()
    try:
        cfg = make_config(dict(explicit))
        torch.set_num_threads(max(1, cfg.threads))
        train(cfg, resume=resume)
        return {"ok": True, "seconds": time.perf_counter() - t0}
    except Exception as e:  # a run's failure is recorded in summary.json, not fatal
        return {"ok": False, "seconds": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {e}"}


def _in_workers(spec: SweepSpec, todo: list[RunSpec], status: dict[str, dict],
                bar: ui.Bar) -> None:
    """Run `todo` in worker processes. Ctrl-C (or any failure of the sweep itself) stops them
    all: no queued run starts after it, the running ones are stopped (each is set aside when
    the sweep runs again), and the finished ones stay finished, to be skipped then."""
    ctx = get_context("spawn")  # fresh interpreters: no forked torch thread pools
    before = set(active_children())
    pool = ProcessPoolExecutor(_workers(spec, len(todo)), mp_context=ctx,
                               initializer=_start_worker, initargs=(os.getpid(),))
    try:
        futures = {pool.submit(_run_one, r.explicit, "continued" in status.get(r.name, {})): r
                   for r in todo}
        started = [w for w in active_children() if w not in before]
        for f in as_completed(futures):
            r = futures[f]
            try:
                result = f.result()
            except BrokenProcessPool:
                # Ctrl-C reaches the workers too, and the pool can report them dead before this
                # process's own KeyboardInterrupt is raised: the interrupt is what happened.
                if any(w.exitcode == -signal.SIGINT for w in started):
                    raise KeyboardInterrupt from None
                raise
            status[r.name] = {**status.get(r.name, {}), **result}
            bar.advance()
    except BaseException:
        # A pool's shutdown waits for every queued run, and a worker hands an interrupt back
        # as a result and takes the next run: the queue is dropped and the workers ended here.
        pool.shutdown(wait=False, cancel_futures=True)
        workers = [w for w in active_children() if w not in before]
        for w in workers:
            w.terminate()
        for w in workers:
            w.join()
        raise
    pool.shutdown()


def _start_worker(parent: int) -> None:
    """A worker dies with the sweep (`_die_with_parent`), and at Ctrl-C it ends at once, as the
    sweep's own process stops: Python's KeyboardInterrupt would reach the pool's loop, which
    returns it as the run's result and starts the next queued run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """A worker ends when the sweep's process does. Killed by a signal (`kill`, a job
    scheduler's stop), the parent cannot stop its workers itself, and they would go on
    training for nobody, holding the cores. On Linux the kernel sends them SIGTERM then
    (prctl PR_SET_PDEATHSIG); the run they leave is set aside when the sweep runs again."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)


def _cost(run: RunSpec) -> float:
    """A run's expected time relative to its grid's others, to start the longest first: fp16
    on the CPU is emulated (parity/models/precision.py) and a step takes ~2.5× an fp32 or bf16
    one on SmolLM2-135M (docs/performance.md). With a pool of 2, a long run started last leaves one
    worker idle for most of its length."""
    cfg = make_config(dict(run.explicit))
    fp16 = "fp16" in (cfg.engine_dtype, cfg.trainer_dtype)
    return 2.5 if fp16 and cfg.device in ("auto", "cpu") and cfg.cpu_fp16 == "emulate" \
        and not _cuda() else 1.0


def _cuda() -> bool:
    return torch.cuda.is_available()


def _workers(spec: SweepSpec, n_runs: int) -> int:
    if spec.workers > 0:
        return min(spec.workers, n_runs)
    return max(1, min(n_runs, (os.cpu_count() or 1) // max(1, spec.threads)))


def run_sweep(spec: SweepSpec, out: Path, progress: bool = True, report: bool = True
              ) -> dict[str, Any]:
    """Run the grid into `out`, held for the sweep's length (`runs.lock_dir`): a second sweep
    into it is refused before it sets aside, or starts, any run the first one is training."""
    runs = plan(spec, out)
    for path in (out, out / "runs"):  # the directory given, then where the runs go
        ensure_writable(path, "sweep --out")
    refuse_other_output(out, "a sweep", "sweep --out")
    with lock_dir(out, "sweep --out"):
        refuse_other_output(out, "a sweep", "sweep --out")  # written before it was held
        return _locked_sweep(spec, runs, out, progress, report)


def _locked_sweep(spec: SweepSpec, runs: list[RunSpec], out: Path, progress: bool,
                   report: bool) -> dict[str, Any]:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    # A run finished by an earlier invocation keeps the figures that one recorded (its time).
    earlier = _earlier_summary(out)
    todo, status = [], {}
    for r in runs:
        if finished(r):
            before = earlier.get("runs", {}).get(r.name, {})
            status[r.name] = {**({"seconds": before["seconds"]} if "seconds" in before else {}),
                              "ok": True, "skipped": True}
            continue
        if r.path.exists():
            status[r.name] = {"set_aside": str(_set_aside(r.path))}
        if spec.continue_from is not None and _copy_earlier(r, spec.continue_from):
            status[r.name] = {**status.get(r.name, {}), "continued": str(
                spec.continue_from / "runs" / r.name)}
        todo.append(r)
    todo.sort(key=_cost, reverse=True)   # stable: equal costs keep the grid's order
    t0 = time.perf_counter()
    # The testbed models and the arith filter are built once here, not raced by the workers.
    _prebuild(todo)
    with ui.progress("sweep", len(todo), progress) as bar:
        if _workers(spec, len(todo)) == 1 or len(todo) <= 1:
            for r in todo:
                status[r.name] = {**status.get(r.name, {}),
                                  **_run_one(r.explicit, "continued" in status.get(r.name, {}))}
                bar.advance()
        elif todo:
            _in_workers(spec, todo, status, bar)
    # the wall time of every invocation that ran this grid's runs, this one included
    summary = summarize(runs, status, time.perf_counter() - t0
                        + (earlier.get("seconds") or 0.0 if len(todo) < len(runs) else 0.0))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if report:
        groups: dict[str, list[Path]] = {}
        for r in runs:
            if status[r.name].get("ok"):
                groups.setdefault(r.group, []).append(r.path)
        if groups:
            sweep_report(groups, out)
    return summary


def _earlier_summary(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _prebuild(todo: list[RunSpec]) -> None:
    seen = set()
    for r in todo:
        cfg = make_config(dict(r.explicit))
        key = (cfg.task, cfg.model, cfg.seed if cfg.task == "arith" else 0, cfg.max_new_tokens)
        if key not in seen:
            seen.add(key)
            load_model_and_task(cfg)


# ---- summary ---------------------------------------------------------------------------------

def steps_to_threshold(rows: list[dict[str, Any]], task: str) -> int | None:
    """First step whose trailing WINDOW-step mean passes the task's threshold; None if never."""
    if Path(task).stem not in THRESHOLDS:
        return None
    key, op, value = THRESHOLDS[Path(task).stem]
    vals: list[float] = []
    for r in rows:
        if isinstance(r.get(key), (int, float)):
            vals.append(float(r[key]))
        if len(vals) >= WINDOW:
            m = statistics.fmean(vals[-WINDOW:])
            if (m <= value) if op == "<=" else (m >= value):
                return int(r[mn.STEP])
    return None


def peak_reward(rows: list[dict[str, Any]]) -> float | None:
    """The best trailing WINDOW-step mean of the reward: a peak that one lucky step cannot make,
    to set the last steps' mean against (has training degraded since?)."""
    vals = [float(r[mn.REWARD_MEAN]) for r in rows
            if isinstance(r.get(mn.REWARD_MEAN), (int, float))]
    if len(vals) < WINDOW:
        return None
    return max(statistics.fmean(vals[i - WINDOW:i]) for i in range(WINDOW, len(vals) + 1))


def run_summary(path: Path, task: str) -> dict[str, Any]:
    rows = load_metrics(path / "metrics.jsonl")

    def mean(key: str, rs: list[dict]) -> float | None:
        v = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return statistics.fmean(v) if v else None
    last = rows[-WINDOW:]
    return {"steps": len(rows), "steps_to_threshold": steps_to_threshold(rows, task),
            "final_reward": mean(mn.REWARD_MEAN, last),
            "final_len": mean(mn.LEN_MEAN, last),
            "best_reward": max(r[mn.REWARD_MEAN] for r in rows),
            "peak_reward": peak_reward(rows),
            "early_clip_frac": mean(mn.CLIP_FRAC, rows[:EARLY]),
            "early_phantom_frac": mean(mn.PHANTOM_FRAC, rows[:EARLY]),
            "beta_abs_mean": mean(mn.BETA_ABS_MEAN, rows),
            "beta_mean": mean(mn.BETA_MEAN, rows),
            "kl_k3": mean(mn.KL_K3, rows), "kl_exact": mean(mn.KL_EXACT, rows),
            # the mismatch at the start and at the end of training (does it grow?)
            **{f"{name}_{end}": mean(key, part) for name, key in MISMATCH_OVER_TRAINING
               for end, part in (("first", rows[:EARLY]), ("last", rows[-EARLY:]))},
            "changed_frac": mean(mn.SYNC_CHANGED_FRAC, rows[1:] or rows),
            "step_s": mean(mn.STEP_S, rows)}


def summarize(runs: list[RunSpec], status: dict[str, dict], seconds: float) -> dict[str, Any]:
    per_run, groups = {}, {}
    for r in runs:
        entry = {"group": r.group, "recipe": r.explicit["recipe"], "seed": r.explicit["seed"],
                 "task": r.explicit["task"], "path": str(r.path), **status.get(r.name, {})}
        if entry.get("ok") and (r.path / "metrics.jsonl").is_file():
            entry.update(run_summary(r.path, r.explicit["task"]))
        per_run[r.name] = entry
        groups.setdefault(r.group, []).append(entry)
    per_group = {}
    for g, entries in groups.items():
        ok = [e for e in entries if "steps" in e]
        agg: dict[str, Any] = {"recipe": entries[0]["recipe"], "task": entries[0]["task"],
                               "runs": len(entries), "failed": len(entries) - len(ok)}
        for key in ("final_reward", "final_len", "early_phantom_frac", "early_clip_frac",
                    "beta_abs_mean", "beta_mean", "kl_k3", "kl_exact", "changed_frac", "step_s"):
            v = [e[key] for e in ok if e.get(key) is not None]
            if v:
                agg[key] = statistics.fmean(v)
                agg[key + "_std"] = statistics.stdev(v) if len(v) > 1 else 0.0
        reached = [e["steps_to_threshold"] for e in ok]
        agg["reached"] = sum(s is not None for s in reached)
        # Runs that never reached the threshold count as their step budget: a lower bound.
        budget = [s if s is not None else e["steps"] + 1 for s, e in zip(reached, ok)]
        agg["steps_to_threshold_median"] = statistics.median(budget) if budget else None
        agg["steps_to_threshold_runs"] = budget   # per seed: claims weigh the spread
        agg["final_reward_runs"] = [e["final_reward"] for e in ok]
        agg["reward_drop_runs"] = [e["peak_reward"] - e["final_reward"] for e in ok
                                   if e.get("peak_reward") is not None]
        per_group[g] = agg
    return {"seconds": seconds, "thresholds": {k: list(v) for k, v in THRESHOLDS.items()},
            "window": WINDOW, "runs": per_run, "groups": per_group}


def print_summary(summary: dict[str, Any]) -> None:
    t = Table(title=f"sweep: {len(summary['runs'])} runs, {summary['seconds'] / 60:.1f} min")
    for col in ("group", "seeds", "reached", "median steps to threshold", "final reward",
                "early phantom", "|beta|", "KL k3", "failed"):
        t.add_column(col, justify="left" if col == "group" else "right")

    def f(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)
    for g, a in summary["groups"].items():
        t.add_row(g, str(a["runs"]), f"{a['reached']}/{a['runs'] - a['failed']}",
                  f(a.get("steps_to_threshold_median"), "g"), f(a.get("final_reward"), ".3f"),
                  f(a.get("early_phantom_frac"), ".2%"), f(a.get("beta_abs_mean"), ".3g"),
                  f(a.get("kl_k3"), ".3g"), str(a["failed"]))
    ui.console().print(t)
