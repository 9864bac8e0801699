"""The engine's decode throughput against completion length: transformers' eager attention
against parity's (`parity.engines.engine_attention`), alternated in one process.

    python bench/decode_length.py                                   # smollm2-135m, bf16
    python bench/decode_length.py --model text --lengths 64,256 --rows 16

Every row decodes the full length (the end-of-sequence id is one no token has), from the same
prompts and the same random numbers on both sides; the table gives completion tokens per
second for each side, their ratio, and whether both sides sampled the same tokens. Alternating
the sides at each length puts drift of a shared machine on both.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--lengths", default="64,256,512,1024")
    a = ap.parse_args()

    from parity import testbed
    from parity.engines import ENGINE_ATTENTION, HFEngine, Sampling
    from parity.runs import load_policy
    model, tok = load_policy(testbed.resolve_model(a.model))
    prompts = [tok(p)["input_ids"] for p in testbed.text_prompts(a.rows, seed=0)]
    engine = HFEngine(model, a.dtype, -1, tok.pad_token_id)   # -1: no row ever stops early
    print(f"{a.model}, {a.dtype} engine, {a.rows} rows, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {torch.get_num_threads()} threads\n")
    print("| new tokens | eager tokens/s | parity tokens/s | parity / eager | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for n in map(int, a.lengths.split(",")):
        rate, out = {}, {}
        for attn in ("eager", ENGINE_ATTENTION):
            engine.model.set_attn_implementation(attn)
            t0 = time.perf_counter()
            out[attn] = engine.generate(prompts, n, Sampling(), torch.Generator().manual_seed(0))
            rate[attn] = float(out[attn].completion_mask.sum()) / (time.perf_counter() - t0)
        same = torch.equal(out["eager"].completion_ids, out[ENGINE_ATTENTION].completion_ids)
        print(f"| {n} | {rate['eager']:.0f} | {rate[ENGINE_ATTENTION]:.0f} | "
              f"{rate[ENGINE_ATTENTION] / rate['eager']:.2f} | {'yes' if same else 'no'} |",
              flush=True)


if __name__ == "__main__":
    main()
