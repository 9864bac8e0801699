"""Why `cpu_fp16: emulate` is the default: fp16 matrix products on this CPU, native vs emulated.

    python -m bench.fp16_cpu [--model arith]

Times matrix products of a testbed-sized shape and of 1024^3 per dtype, then one fp16 trainer
forward + backward (64 completions) with torch's native CPU fp16 kernels and with the emulation
(fp16 inputs, float64 accumulation, fp16 output). Each time is the median of its timed calls
after a warm-up (bench/timing.py). Ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from bench.report import Table, json_option, publish
from bench.timing import measure
from parity import testbed
from parity.engines.hf import HFEngine
from parity.logprobs import Sampling
from parity.models.forward import score
from parity.models.loading import load_policy
from parity.models.precision import FP16MatmulOnCPU, autocast
from parity.tasks.data import arith_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.DEFAULT_ARITH)
    args = json_option(ap, "fp16_cpu").parse_args()
    kinds = ("fp32", "bf16", "fp16 native", "fp16 emulated")
    t = Table("products", "matrix products on CPU, median of 5 after a warm-up",
              [("shape", None)] + [(f"{k} {u}", f) for k in kinds
                                   for u, f in (("ms", "{:.2f}"), ("GFLOP/s", "{:.0f}"))]
              + [("native / emulated", "{:.1f}x")])
    for m, k, n in ((768, 128, 512), (1024, 1024, 1024)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        secs = {}
        for name, dt, mode in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                               ("fp16 native", torch.float16, None),
                               ("fp16 emulated", torch.float16, FP16MatmulOnCPU)):
            a, b = x.to(dt), w.to(dt)

            def run(a=a, b=b, mode=mode):
                if mode is None:
                    return F.linear(a, b)
                with mode():
                    return F.linear(a, b)
            secs[name] = measure(run, repeats=5).median
        t.add(f"{m}x{k} @ {k}x{n}",
              *(v for name in kinds for v in (secs[name] * 1e3, 2 * m * k * n / secs[name] / 1e9)),
              secs["fp16 native"] / secs["fp16 emulated"])

    model, tok = load_policy(testbed.resolve_model(args.model))
    rng = random.Random(0)
    prompts = [tok(arith_problem(rng)[0] if "arith" in args.model else "def f(x):")
               ["input_ids"] for _ in range(64)]
    r = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        prompts, 8, Sampling(), torch.Generator().manual_seed(0))
    s = Table("trainer", f"fp16 trainer forward + backward on {args.model}, 64 completions, "
                         f"median of 3 after a warm-up (s)",
              [("kernels", None), ("forward", "{:.3f}"), ("backward", "{:.3f}")])
    for mode in ("native", "emulate"):
        def fwd(mode=mode):
            with autocast("fp16", torch.device("cpu"), mode):
                return score(model, r, Sampling()).sum()
        f = measure(fwd, repeats=3).median
        b = measure(lambda: fwd().backward(), repeats=3).median - f
        model.zero_grad(set_to_none=True)
        s.add(mode, f, b)
    publish("fp16_cpu", [t, s], args)

if __name__ == "__main__":
    main()
