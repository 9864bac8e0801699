"""The kernel gap |α| at θ = θ_old, by the shadow forward's attention implementation.

    python bench/kernel_gap.py                 # ladder-w512, bf16, 128 completions of <= 32 tokens
    python bench/kernel_gap.py --device cuda --model smollm2-135m --prompts 8 --new-tokens 64

α = ℓ_s − ℓ_μ should be the policy change alone; at equal weights it is the kernel gap, the
difference between the engine's KV-cache decode and the shadow's full forward, both in engine
precision. The engine decodes with parity's attention (`parity.engines.engine_attention`: eager's
arithmetic over the filled part of its KV cache). This prints the gap with the shadow on each
implementation: `sdpa` is the trainer's own (`shadow_kernels: independent`), `parity_eager` the
engine's (`shadow_kernels: engine`, the default), `eager` transformers' eager attention. A shadow
that attends like the engine leaves only the cache-versus-full-forward difference.

On CUDA the rows are repeated with cuBLAS's reduced-precision reductions in bf16/fp16 matrix
products turned off (torch allows them by default), to tell the matrix products' share of the
gap from the attention's.
"""

from __future__ import annotations

import argparse

import torch

from parity import devices, testbed
from parity.engines import ENGINE_ATTENTION, HFEngine, Sampling
from parity.scoring import score
from parity.precision import low_precision_copy
from parity.runs import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = ap.parse_args()
    dev = devices.resolve(a.device)
    master, tok = load_policy(testbed.ensure(a.model))
    master.to(dev)
    prompts = [tok(p)["input_ids"] for p in testbed.text_prompts(a.prompts)]
    engine = HFEngine(master, a.dtype, tok.eos_token_id, tok.pad_token_id)
    print(f"{a.model}, {a.dtype} engine ({ENGINE_ATTENTION} attention), {devices.describe(dev)}\n")
    print("| reduced-precision reductions | shadow attention | tokens | kernel gap mean |α| "
          "| max |α| |")
    print("|---|---|---|---|---|")
    mm = torch.backends.cuda.matmul
    for reduced in ((True, False) if dev.type == "cuda" else (True,)):
        # the engine samples under the same setting as the shadow scores
        mm.allow_bf16_reduced_precision_reduction = reduced
        mm.allow_fp16_reduced_precision_reduction = reduced
        r = engine.generate([p for p in prompts for _ in range(a.group)], a.new_tokens,
                            Sampling(), torch.Generator().manual_seed(0))
        mask = r.completion_mask
        for attn in ("sdpa", "eager", ENGINE_ATTENTION):
            shadow = low_precision_copy(master, a.dtype)
            shadow.set_attn_implementation(attn)
            with torch.no_grad():
                alpha = (score(shadow, r, Sampling()) - r.engine_logprobs).abs() * mask
            print(f"| {'allowed' if reduced else 'off'} | {attn} | {int(mask.sum())} | "
                  f"{float(alpha.sum() / mask.sum()):.2e} | {float(alpha.max()):.2e} |")

if __name__ == "__main__":
    main()
