"""How far each engine's ℓ_μ is from a float64 reference at low temperatures.

    python scripts/low_temperature.py [--cache DIR]

For T in 1e-6, 1e-4, 0.01 and 1, both engines (fp32) sample 8 prompts x 12 tokens of the
testbed's text-xs; the reference is log softmax(z / T) of each sampled token, z from one plain
transformers forward of the same weights over the whole sequence, in float64. Prints the largest
|ℓ_μ − reference| and the mean ℓ_μ per engine and temperature. The engines are called directly,
past the refusal a run makes (docs/vllm.md): vLLM samples every temperature below 0.01 at 0.01.
Needs vLLM's CPU build (README.md) for the vllm rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="PARITY_CACHE holding (or to hold) the testbed models")
    args = ap.parse_args()
    if args.cache:
        os.environ["PARITY_CACHE"] = args.cache
    import torch

    from parity import testbed
    from parity.engines import EngineSpec, make_engine
    from parity.logprobs import Sampling
    from parity.models.loading import load_policy
    from test_low_temperature import TEMPERATURES, reference_logprobs
    from vllm_helpers import prompts_of
    model_dir = testbed.ensure(testbed.TEST_TEXT, progress=False)
    model, tok = load_policy(model_dir)
    model.eval()
    print("| engine | T | max \\|ℓ_μ − reference\\| | mean ℓ_μ |\n|---|---|---|---|")
    for name in ("hf", "vllm"):
        eng = make_engine(name, EngineSpec(model, str(model_dir), "fp32", [tok.eos_token_id],
                                           tok.pad_token_id, 0, 64, 8))
        eng.sync(model)
        for T in TEMPERATURES:
            r = eng.generate(prompts_of(tok), 12, Sampling(T, 1.0, 0),
                             torch.Generator().manual_seed(0))
            got = r.engine_logprobs.double() * r.completion_mask
            err = float((got - reference_logprobs(model, r, T)).abs().max())
            mean = float(got.sum() / r.completion_mask.sum())
            print(f"| {name} | {T:g} | {err:.3g} | {mean:.4f} |")
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
