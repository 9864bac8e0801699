"""Why `cpu_fp16: emulate` is the default: fp16 matrix products on this CPU, native vs emulated.

    python bench/fp16_cpu.py [--model arith]

Times matrix products of a testbed-sized shape and of 1024^3 per dtype, then one fp16 trainer
forward + backward (64 completions) with torch's native CPU fp16 kernels and with the emulation
(fp16 inputs, float64 accumulation, fp16 output). Ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import arith, testbed  # noqa: E402
from parity.engines.hf import HFEngine
from parity.engines import Sampling
from parity.engines.scoring import score  # noqa: E402
from parity.precision import FP16MatmulOnCPU, autocast  # noqa: E402
from parity.runs import load_policy  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.DEFAULT_ARITH)
    args = ap.parse_args()
    t = Table(title="matrix products on CPU (ms; GFLOP/s)")
    for col in ("shape", "fp32", "bf16", "fp16 native", "fp16 emulated", "native / emulated"):
        t.add_column(col, justify="right")
    for m, k, n in ((768, 128, 512), (1024, 1024, 1024)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        cells, secs = [], {}
        for name, dt, mode in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                               ("native", torch.float16, None),
                               ("emulated", torch.float16, FP16MatmulOnCPU)):
            a, b = x.to(dt), w.to(dt)

            def run(a=a, b=b, mode=mode):
                if mode is None:
                    return F.linear(a, b)
                with mode():
                    return F.linear(a, b)
            secs[name] = timed(run)
            cells.append(f"{secs[name] * 1e3:.2f}; {2 * m * k * n / secs[name] / 1e9:.0f}")
        t.add_row(f"{m}x{k} @ {k}x{n}", *cells, f"{secs['native'] / secs['emulated']:.1f}x")
    Console(width=160).print(t)

    model, tok = load_policy(testbed.resolve_model(args.model))
    rng = random.Random(0)
    prompts = [tok(arith.problem(rng)[0] if "arith" in args.model else "def f(x):")
               ["input_ids"] for _ in range(64)]
    r = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        prompts, 8, Sampling(), torch.Generator().manual_seed(0))
    s = Table(title=f"fp16 trainer forward + backward on {args.model}, 64 completions (s)")
    for col in ("kernels", "forward", "backward"):
        s.add_column(col, justify="right")
    for mode in ("native", "emulate"):
        def fwd(mode=mode):
            with autocast("fp16", torch.device("cpu"), mode):
                return score(model, r, Sampling()).sum()
        f = timed(fwd, 3)
        b = timed(lambda: fwd().backward(), 3) - f
        model.zero_grad(set_to_none=True)
        s.add_row(mode, f"{f:.3f}", f"{b:.3f}")
    Console(width=160).print(s)


if __name__ == "__main__":
    main()
