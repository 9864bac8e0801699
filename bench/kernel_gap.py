"""The kernel gap |α| at θ = θ_old, by the shadow forward's attention implementation.

    python bench/kernel_gap.py                 # ladder-w512, bf16, 128 completions of <= 32 tokens

α = ℓ_s − ℓ_μ should be the policy change alone; at equal weights it is the kernel gap, the
difference between the engine's KV-cache decode and the shadow's full forward, both in engine
precision. The engine decodes with parity's attention (`parity.engines.engine_attention`: eager's
arithmetic over the filled part of its KV cache). This prints the gap with the shadow on each
implementation: `sdpa` is the trainer's own (`shadow_kernels: independent`), `parity_eager` the
engine's (`shadow_kernels: engine`, the default), `eager` transformers' eager attention. A shadow
that attends like the engine leaves only the cache-versus-full-forward difference.
"""

from __future__ import annotations

import argparse

import torch

from parity import testbed
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
    a = ap.parse_args()
    master, tok = load_policy(testbed.ensure(a.model))
    prompts = [tok(p)["input_ids"] for p in testbed.text_prompts(a.prompts)]
    engine = HFEngine(master, a.dtype, tok.eos_token_id, tok.pad_token_id)
    r = engine.generate([p for p in prompts for _ in range(a.group)], a.new_tokens, Sampling(),
                        torch.Generator().manual_seed(0))
    mask = r.completion_mask
    print(f"{a.model}, {a.dtype} engine ({ENGINE_ATTENTION} attention), {int(mask.sum())} tokens\n")
    print("| shadow attention | kernel gap mean |α| | max |α| |")
    print("|---|---|---|")
    for attn in ("sdpa", "eager", ENGINE_ATTENTION):
        shadow = low_precision_copy(master, a.dtype)
        shadow.set_attn_implementation(attn)
        with torch.no_grad():
            alpha = (score(shadow, r, Sampling()) - r.engine_logprobs).abs() * mask
        print(f"| {attn} | {float(alpha.sum() / mask.sum()):.2e} | {float(alpha.max()):.2e} |")


if __name__ == "__main__":
    main()
