"""The longest completions each side trains at in this machine's memory, predicted from short runs.

    python -m bench.longest                          # TRL and parity's fp32 on qwen3-narrow-long
    python -m bench.longest --parity fp32,fp32:logprob_chunk=-1 --lengths 512,1024,2048
    python -m bench.longest --memory-gb 16 --no-verify

Training at ever longer completions until the kernel's OOM killer fires is slow, and on a shared
machine it may kill someone else's process. So each side (bench/vs_trl.py's workers: TRL's
GRPOTrainer as that bench sets it, parity's runs as its `--parity` names them, on the same
workload) trains at a few completion lengths T (`--lengths`), one step of 1 prompt x 2 completions
by default. `qwen3-narrow-long` is Qwen3's vocabulary and a 32,768-token context on a 2-layer body
with random weights: it samples EOS about once in 140,000 tokens (p = 7e-6), so completions run to
the budget (the trials table gives their mean length). Each side's peak resident memory is fitted
as a + b·T by least squares, or as a + b·T + c·T² where three or more lengths show the growth
speeding up by more than the allocator's noise explains (`CURVED`; attention's scores, where a
kernel keeps them, grow with T²). The longest T is where the fit reaches the memory a run may use
(`--memory-gb`, default this machine's MemTotal, less `--margin-gb`), capped by the model's
context. One run at that length checks it, and the fit is made again with it; `--no-verify` skips
it, and it is skipped where less memory is free now than the fit predicts, or where the same fit of
the trials' wall times says it would take over `--verify-minutes`. A watchdog stops any run whose
resident memory passes the machine's memory less half the margin, and each worker offers itself
first to the kernel's OOM killer.

Every other option is bench/vs_trl.py's (`--model`, `--task`, `--prompts`, `--group`, `--steps`,
`--lr`, `--micro-batch`, `--parity`, ...), with this bench's defaults: qwen3-narrow-long,
neg-length, 1 prompt x 2 completions, 1 step, lr 1e-6.
"""

from __future__ import annotations

import argparse
import math

from bench import vs_trl
from bench.report import Table, json_option, publish

DEFAULTS = dict(model="qwen3-narrow-long", task="neg-length", prompts=1, group=2, steps=1,
                lr=1e-6, json="")


# How much faster the growth over the two longest lengths must be than over the two shortest
# for a fit to take a curvature: the allocator moves a peak by ~0.1 GiB from run to run (the
# trials at 64-256 tokens), which alone makes the slopes differ by ~15% at 512-2048 tokens.
CURVED = 1.25


def fit(ts: list[float], ys: list[float]) -> tuple[float, float, float]:
    """a, b, c of y = a + b·T + c·T²: a line by least squares, or a parabola where three or more
    lengths show the growth speeding up (`CURVED`). Three points alone would give every pair of
    noisy peaks a curvature, and extrapolated far the curvature decides the answer."""
    import numpy as np
    pts = sorted(zip(ts, ys))
    (t0, y0), (t1, y1), (t2, y2), (t3, y3) = pts[:2] + pts[-2:]
    if len(pts) >= 3 and (y3 - y2) / (t3 - t2) > CURVED * max(0.0, (y1 - y0) / (t1 - t0)):
        c, b, a = np.polyfit(ts, ys, 2)
        if c > 0:
            return float(a), float(b), float(c)
    b, a = np.polyfit(ts, ys, 1)
    return float(a), float(b), 0.0


def at(coef: tuple[float, float, float], t: float) -> float:
    a, b, c = coef
    return a + b * t + c * t * t


def reach(coef: tuple[float, float, float], y: float) -> float:
    """The T at which the fit reaches y: 0 where it starts above, inf where it never does."""
    a, b, c = coef
    if c > 0:
        return max(0.0, (-b + math.sqrt(max(0.0, b * b + 4 * c * (y - a)))) / (2 * c))
    return max(0.0, (y - a) / b) if b > 0 else math.inf


def _context(w: argparse.Namespace) -> int:
    """The longest completion the model's positions hold after the task's longest prompt."""
    from transformers import AutoConfig

    from parity import testbed
    model_dir = testbed.ensure(w.model, progress=False)
    cfg = AutoConfig.from_pretrained(model_dir)
    positions = getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
    return positions - vs_trl.longest_prompt(w, model_dir)


def trial(side: str, w: argparse.Namespace, t: int, cap_gb: float) -> dict:
    """One run of `side` at completions of `t` tokens: its peak, mean completion length and
    wall time, or its error."""
    r = vs_trl.run_worker(side, argparse.Namespace(**{**vars(w), "max_new_tokens": t}), cap_gb)
    if "error" in r:
        return {"t": t, "error": r["error"]}
    return {"t": t, "peak_gb": r["peak_gb"], "run_s": r["run_s"],
            "tokens": sum(r["tokens"]) / len(r["tokens"]) / (w.prompts * w.group)}


def trials(names: list[str], w: argparse.Namespace, lengths: list[int],
           cap_gb: float) -> dict[str, list[dict]]:
    """Every side at every length, shortest first, alternating the order of the sides; a side
    that failed at a length is not run at a longer one."""
    out: dict[str, list[dict]] = {n: [] for n in names}
    for i, t in enumerate(lengths):
        for side in (names if i % 2 == 0 else names[::-1]):
            if out[side] and "error" in out[side][-1]:
                continue
            print(f"trial: {side} at {t} tokens ...", flush=True)
            out[side].append(trial(side, w, t, cap_gb))
    return out


def predict(runs: list[dict], limit_gb: float, context: int) -> dict | None:
    """The fits of peak memory and wall time over a side's trials, and the longest T: where
    memory reaches `limit_gb`, or the context where that comes first."""
    ok = [r for r in runs if "error" not in r]
    if len({r["t"] for r in ok}) < 2:
        return None
    ts = [r["t"] for r in ok]
    mem, time_s = fit(ts, [r["peak_gb"] for r in ok]), fit(ts, [r["run_s"] for r in ok])
    t = reach(mem, limit_gb)
    by = "memory" if t < context else "context"
    t = int(min(t, context))
    return {"mem": mem, "time": time_s, "t": t, "by": by, "peak_gb": at(mem, t),
            "run_s": at(time_s, t), "runs": ok}


def verify(side: str, w: argparse.Namespace, p: dict, a: argparse.Namespace,
           cap_gb: float) -> dict:
    """One run at the predicted length, where asked and affordable; else why not."""
    free = vs_trl.proc_gb("/proc/meminfo", "MemAvailable")
    if a.no_verify:
        return {"why": "not asked (--no-verify)"}
    if p["t"] < 1:
        return {"why": "nothing fits"}
    if p["run_s"] > 60 * a.verify_minutes:
        return {"why": f"would take ~{p['run_s'] / 60:.0f} min (--verify-minutes "
                       f"{a.verify_minutes:g})"}
    if free is not None and p["peak_gb"] > free:
        return {"why": f"needs ~{p['peak_gb']:.1f} GiB, {free:.1f} GiB free now"}
    print(f"verify: {side} at {p['t']} tokens ...", flush=True)
    r = trial(side, w, p["t"], cap_gb)
    return {**r, "why": r.get("error", "ran")}


def table(preds: dict, checks: dict, a: argparse.Namespace, w: argparse.Namespace,
          limit_gb: float, context: int) -> Table:
    t = Table("longest", f"the longest completions each side trains at in {limit_gb:.1f} GiB "
              f"({a.memory_gb:.1f} GiB less a {a.margin_gb:g} GiB margin): {w.model} on "
              f"{w.task} (cpu), {w.prompts} prompt(s) x {w.group} completions, {w.steps} "
              f"step(s), {w.trainer_dtype} trainer, peak resident memory fitted over T = "
              f"{', '.join(map(str, a.lengths))}",
              [("side", None), ("base GiB", "{:.2f}"), ("MiB per token", "{:.3g}"),
               ("KiB per token²", "{:.3g}"), ("longest T", "{:.0f}"), ("limited by", None),
               ("predicted peak GiB", "{:.2f}"), ("predicted run min", "{:.1f}"),
               ("verified peak GiB", "{:.2f}"), ("verified tokens", "{:.0f}"),
               ("verified run min", "{:.1f}"), ("refit longest T", "{:.0f}"), ("verify", None)])
    for side, p in preds.items():
        if p is None:
            t.add(side, *[None] * 11, "too few trials ran")
            continue
        (a0, b, c), v = p["mem"], checks.get(side, {"why": "not yet"})
        refit = predict([*p["runs"], v], limit_gb, context) if "peak_gb" in v else None
        t.add(side, a0, b * 1024, c * 2 ** 20, p["t"], p["by"], p["peak_gb"], p["run_s"] / 60,
              v.get("peak_gb"), v.get("tokens"), v["run_s"] / 60 if "run_s" in v else None,
              refit and refit["t"], v["why"])
    t.notes += ["peak: the side's process at its peak resident memory (ru_maxrss); base: the "
                "fit at T = 0; run min: the process's wall time, start-up included",
                "verified tokens: the mean completion length of the run at the longest T (a "
                "completion that samples EOS ends short of it); refit: the same fit over the "
                "trials and that run"]
    return t


def trials_table(runs: dict[str, list[dict]]) -> Table:
    t = Table("longest_trials", "the trials the fits are made over",
              [("side", None), ("T", "{:.0f}"), ("peak GiB", "{:.3f}"),
               ("mean completion tokens", "{:.0f}"), ("run s", "{:.1f}"), ("error", None)])
    for side, rs in runs.items():
        for r in rs:
            t.add(side, r["t"], r.get("peak_gb"), r.get("tokens"), r.get("run_s"),
                  r.get("error"))
    return t


def parse() -> tuple[argparse.Namespace, argparse.Namespace, argparse.ArgumentParser]:
    """This bench's options, and bench/vs_trl.py's for the rest with this bench's defaults."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                 epilog="Every other option is bench/vs_trl.py's (python -m "
                                 "bench.vs_trl --help).")
    ap.add_argument("--lengths", default=[512, 1024, 2048],
                    type=lambda v: sorted({int(x) for x in v.split(",")}),
                    help="completion lengths to fit over, comma-separated (default: "
                    "512,1024,2048; three or more can show the growth speeding up)")
    total = vs_trl.proc_gb("/proc/meminfo", "MemTotal")
    ap.add_argument("--memory-gb", type=float, default=total, required=total is None,
                    help=f"the machine's memory, GiB (default: MemTotal, {total or 0:.1f})")
    ap.add_argument("--margin-gb", type=float, default=2.0, help="memory left to the system "
                    "and to other work, GiB (default: 2)")
    ap.add_argument("--no-verify", action="store_true", help="predict only: no run at the "
                    "predicted length")
    ap.add_argument("--verify-minutes", type=float, default=30.0, help="skip a check the "
                    "trials' wall times predict to take longer (default: 30)")
    a, rest = json_option(ap, "longest").parse_known_args()
    vs = vs_trl.parser()
    vs.set_defaults(**DEFAULTS)
    return a, vs.parse_args(rest), vs


def main() -> None:
    a, w, vs = parse()
    if w.device != "cpu":
        vs.error("bench.longest measures resident memory: --device cpu only")
    names = vs_trl.sides(w)
    vs_trl.check_sides(vs, w, names)
    from parity import testbed
    testbed.ensure(w.model)  # built once, before any run
    context, limit = _context(w), a.memory_gb - a.margin_gb
    # The watchdog's line, halfway into the margin: a check a little past the limit still
    # reports its peak, and the system keeps half the margin.
    cap = a.memory_gb - a.margin_gb / 2
    runs = trials(names, w, a.lengths, cap)
    preds = {n: predict(rs, limit, context) for n, rs in runs.items()}
    checks: dict[str, dict] = {}
    for side in [None, *(n for n, p in preds.items() if p is not None)]:
        if side is not None:
            checks[side] = verify(side, w, preds[side], a, cap)
        # written before each check and after it: a bench stopped then keeps what it measured
        publish("longest", [table(preds, checks, a, w, limit, context), trials_table(runs)],
                argparse.Namespace(**{**vars(w), **vars(a)}))


if __name__ == "__main__":
    main()
