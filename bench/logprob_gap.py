"""Engine log-probs against a full fp32 trainer forward on the same tokens, per engine dtype.

    python -m bench.logprob_gap [--model text] [--samples 256] [--max-new-tokens 24] \\
        [--engines hf,vllm]

The engine samples with its KV cache in its own precision; the trainer rescores the same tokens
with one full fp32 forward. With an fp32 engine the two agree to float rounding; with bf16 or
fp16 the gap is the raw material of β.
"""

from __future__ import annotations

import argparse

import torch

from bench.report import Table, engines_option, json_option, publish
from parity import testbed
from parity.engines import EngineSpec, make_engine, stop_token_ids
from parity.logprobs import Sampling
from parity.models.forward import score
from parity.models.loading import load_policy
from parity.tasks.data import text_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.DEFAULT_TEXT)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = json_option(engines_option(ap), "logprob_gap").parse_args()
    path = testbed.resolve_model(args.model)
    model, tok = load_policy(path)
    model.eval()
    prompts = [tok(p)["input_ids"] for p in text_prompts(args.samples, seed=0)]
    t = Table("logprob_gap", f"|ℓ_engine − ℓ_trainer(fp32)| on {args.model}, {args.samples} "
                             f"samples at T=1",
              [("engine", None, "right"), ("tokens", "{}"), ("max", "{:.2e}"), ("mean", "{:.2e}"),
               ("kl_k1 (mean ℓ_μ − ℓ_π)", "{:+.2e}")])
    for name, dtype in [(e, d) for e in args.engines for d in ("fp32", "bf16", "fp16")]:
        engine = make_engine(name, EngineSpec(model, str(path), dtype, stop_token_ids(model, tok),
                                              tok.pad_token_id, 0,
                                              max(map(len, prompts)) + args.max_new_tokens,
                                              len(prompts)))
        try:
            engine.sync(model)
            r = engine.generate(prompts, args.max_new_tokens, Sampling(),
                                torch.Generator().manual_seed(0))
        finally:
            engine.close()
        with torch.no_grad():
            lp = score(model, r, Sampling())
        m = r.completion_mask > 0
        d = (r.engine_logprobs - lp)[m].double()
        t.add(f"{name} {dtype}", int(m.sum()), float(d.abs().max()), float(d.abs().mean()),
              float(d.mean()))
    publish("logprob_gap", [t], args)

if __name__ == "__main__":
    main()
