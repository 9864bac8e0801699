"""bf16 on a CPU without bf16 instructions: torch's native kernels against parity's emulation
with fp32 kernels (parity/cpu_bf16.py), beside fp32, side by side in one run.

    python -m bench.bf16_cpu [--repeats 2] [--steps 2] [--build text-xs]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m bench.bf16_cpu   # AVX2's kernels

Three tables: matrix products (one thread, median of 5 after a warm-up); a SmolLM2-135M run with
a bf16 engine and a bf16 trainer against the same run in fp32, each a `parity train` process of
its own, alternated, best of `--repeats`; and a testbed model's build. On a CPU with AMX the
second line above makes oneDNN and ATen's vectorised kernels those of an AVX2-only CPU, where
torch's bf16 products take their slow path; its table title says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.report import Table, json_option, publish
from bench.timing import measure
from parity import cpu_bf16
from parity.metric_names import STEP_S

ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
PATHS = {"native": "native", "emulated": "emulate"}  # the row's name: PARITY_CPU_BF16


def kernels_env() -> str:
    set_ = [f"{k}={os.environ[k]}" for k in ISA_VARS if os.environ.get(k)]
    return ", ".join(set_) if set_ else "this CPU's own kernels"


def products() -> Table:
    t = Table("products", f"matrix products, one thread, median of 5 after a warm-up "
                          f"(GFLOP/s; {kernels_env()})",
              [("product", None), ("fp32", "{:.1f}"), ("bf16 native", "{:.1f}"),
               ("bf16 emulated", "{:.1f}"), ("emulated / native", "{:.1f}x")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for label, shapes, fn in (
                ("F.linear [512, 576] by [1536, 576]", ((512, 576), (1536, 576)), F.linear),
                ("a @ b, 512 x 512", ((512, 512), (512, 512)), torch.matmul)):
            flop = 2 * shapes[0][0] * shapes[0][1] * (shapes[1][0] if fn is F.linear
                                                      else shapes[1][1])
            rates = {}
            for name, dtype, emulate in (("fp32", torch.float32, False),
                                         ("native", torch.bfloat16, False),
                                         ("emulated", torch.bfloat16, True)):
                a, b = (torch.randn(s).to(dtype) for s in shapes)
                with cpu_bf16.kernels(emulate=emulate):
                    secs = measure(lambda a=a, b=b, fn=fn: fn(a, b), repeats=5).median
                rates[name] = flop / secs / 1e9
            t.add(label, rates["fp32"], rates["native"], rates["emulated"],
                  rates["emulated"] / rates["native"])
    finally:
        torch.set_num_threads(threads)
    return t


def _process(argv: list[str], path: str, cwd: Path) -> float:
    """Seconds of one `python -m parity ...` (or -c) process with PARITY_CPU_BF16=`path`."""
    env = {**os.environ, cpu_bf16.ENV: path}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0


def _train_argv(out: Path, bf16: bool, steps: int) -> list[str]:
    dtype = ["--recipe", "bf16-engine", "--trainer-dtype", "bf16"] if bf16 else \
        ["--recipe", "fp32"]
    return ["-m", "parity", "train", "--model", "smollm2-135m", "--task", "neg-length-chat",
            *dtype, "--steps", str(steps), "--prompts-per-step", "2", "--samples-per-prompt", "2",
            "--max-new-tokens", "24", "--no-progress", "--out", str(out)]


def _mean_step(out: Path) -> float:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sum(r[STEP_S] for r in rows) / len(rows)


def smollm2_runs(repeats: int, steps: int, tmp: Path) -> Table:
    t = Table("smollm2", f"SmolLM2-135M, neg-length-chat, {steps} steps of 2 x 2 completions of "
                         f"24 tokens, a process each, alternated, best of {repeats} "
                         f"({kernels_env()})",
              [("run", None), ("bf16 products", None), ("process s", "{:.1f}"),
               ("step s", "{:.2f}"), ("step / fp32's", "{:.2f}x")])
    runs = {"fp32": (False, "native"), "bf16 native": (True, "native"),
            "bf16 emulated": (True, "emulate")}
    best: dict[str, tuple[float, float]] = {}
    for i in range(repeats):
        for name, (bf16, path) in runs.items():
            out = tmp / f"{name.replace(' ', '-')}-{i}"
            wall = _process(_train_argv(out, bf16, steps), path, tmp)
            step = _mean_step(out)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, step)
    for name, (bf16, _) in runs.items():
        wall, step = best[name]
        t.add(name, "—" if not bf16 else name.split()[1], wall, step, step / best["fp32"][1])
    return t


def build(model: str, tmp: Path) -> Table:
    t = Table("build", f"building testbed model {model} from scratch, a process each "
                       f"({kernels_env()})", [("bf16 products", None), ("build s", "{:.1f}")])
    for name, path in PATHS.items():
        code = (f"from parity import testbed; testbed.build({model!r}, "
                f"{str(tmp / name)!r}, force=True, progress=False)")
        t.add(name, _process(["-c", code], path, tmp))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--build", default="text-xs", help="the testbed model to build ('' skips)")
    args = json_option(ap, "bf16_cpu").parse_args()
    from parity import testbed
    testbed.ensure("smollm2-135m")  # converted once, before any run is timed
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tables = [products(), smollm2_runs(args.repeats, args.steps, tmp)]
        if args.build:
            tables.append(build(args.build, tmp))
    publish("bf16_cpu", tables, args)


if __name__ == "__main__":
    main()
