"""What an engine's engine-precision copy of the weights takes: what the vLLM engine would save
by dropping its torch copy (docs/vllm.md), a tied head counted once, as checkpoints write it.

    python scripts/engine_copy.py [--model smollm2-135m] [--dtype bf16]
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    a = p.parse_args()
    from parity import testbed
    from parity.models.loading import load_policy
    from parity.models.precision import copy_bytes, low_precision_copy
    model, _ = load_policy(testbed.resolve_model(a.model))
    copy = low_precision_copy(model, a.dtype)
    n = sum(t.numel() for t in copy.parameters())
    b = copy_bytes(copy)
    print(f"{a.model} {a.dtype} copy: {n:,} parameters, {b:,} bytes ({b / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
