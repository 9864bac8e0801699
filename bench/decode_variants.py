"""One engine decode step, with each speed change of the engine switched on in turn.

    python -m bench.decode_variants                    # ladder-w512, batch 256, bf16 and fp32

Rows, each adding to the one above: the engine as it was (DynamicCache, torch.multinomial, SDPA);
a static KV cache; inverse-CDF sampling (`engines.sample_rows`); eager attention, which is
`HFEngine` today. The loop is the engine's own (`HFEngine._generate`) written out so the parts
can be swapped; the median ms per decode step over 2 runs of 32 tokens, after a warm-up run,
each run timed after its prefill (bench/timing.py).
"""

from __future__ import annotations

import torch
from mfu import workload_parser  # bench/ is the script's own directory
from transformers import DynamicCache, StaticCache

from bench.report import Table, json_option, publish
from bench.timing import measure
from parity import testbed
from parity.engines import sample_rows, uniforms
from parity.logprobs import Sampling, keep_last, left_pad, positions, processed_logits
from parity.models.loading import load_policy
from parity.models.precision import low_precision_copy

VARIANTS = [("DynamicCache, multinomial, sdpa", False, "multinomial", "sdpa"),
            ("+ static KV cache", True, "multinomial", "sdpa"),
            ("+ inverse-CDF sampling", True, "cdf", "sdpa"),
            ("+ eager attention (HFEngine)", True, "cdf", "eager")]


def prefill(model, prompts, new_tokens: int, static: bool) -> tuple:
    """The prompt's forward into a fresh cache: what a decode step starts from."""
    ids, mask = left_pad(prompts, 0)
    cache = (StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
             if static else DynamicCache())
    pos = positions(mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=keep_last(ids.shape[1], 1))
    return out, cache, mask, pos[:, -1:]


def decode(model, state: tuple, new_tokens: int, sampler: str, g: torch.Generator) -> None:
    out, cache, attn, last = state
    B = attn.shape[0]
    with torch.no_grad():
        for _ in range(new_tokens):
            logp = torch.log_softmax(processed_logits(out.logits[:, -1], Sampling()), -1)
            if sampler == "multinomial":
                tok = torch.multinomial(logp.exp(), 1, generator=g).squeeze(-1)
            else:
                tok = sample_rows(logp, uniforms(g, logp.shape[0]))
            logp.gather(-1, tok[:, None])
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype)], dim=1)
            last = last + 1
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=last,
                        past_key_values=cache, use_cache=True)


def main() -> None:
    a = json_option(workload_parser(__doc__, "bf16,fp32"), "decode_variants").parse_args()
    master, tok = load_policy(testbed.ensure(a.model))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, len(tok), (a.batch, a.prompt_tokens), generator=g).tolist()
    dtypes = a.dtypes.split(",")
    table = {}
    for dtype in dtypes:
        model = low_precision_copy(master, dtype)
        for name, static, sampler, attn in VARIANTS:
            model.set_attn_implementation(attn)
            took = measure(lambda st, model=model, sampler=sampler:
                           decode(model, st, a.new_tokens, sampler, g),
                           setup=lambda model=model, static=static:
                           prefill(model, prompts, a.new_tokens, static),
                           warmup=1, repeats=2)
            table[name, dtype] = 1000 * took.median / a.new_tokens
    t = Table("decode_variants", f"{a.model}, batch {a.batch}, prompt {a.prompt_tokens}, "
                                 f"{a.new_tokens} new tokens: ms per decode step",
              [("engine", None)] + [(d, "{:.1f}") for d in dtypes])
    for name, *_ in VARIANTS:
        t.add(name, *(table[name, d] for d in dtypes))
    publish("decode_variants", [t], a)


if __name__ == "__main__":
    main()
