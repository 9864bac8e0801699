"""The engine's decode throughput against completion length: transformers' eager attention
against parity's (`parity.engines.engine_attention`), alternated in one process.

    python -m bench.decode_length                                   # smollm2-135m, bf16
    python -m bench.decode_length --model text --lengths 64,256 --rows 16
    python -m bench.decode_length --sides parity_eager --lengths 64,256,512,1024,2048

Every row decodes the full length (the end-of-sequence id is one no token has), from the same
prompts and the same random numbers on both sides; the table gives completion tokens per
second for each side, their ratio, and whether both sides sampled the same tokens. Alternating
the sides at each length puts drift of a shared machine on both. `--sides parity_eager` times
parity's attention alone (eager needs minutes at 1,024 tokens); `parity_strided` is parity's
attention reading the cache through a strided view, as it did before it copied the keys
(`engines.engine_attention`): `--sides parity_strided,parity_eager` times that copy.

What must grow: a decode step reads every weight once for all rows, and every cached key and
value of each row. With one side the table adds that floor: the bytes a step must read (the
engine's weights, plus each row's cache at its length), at the copy bandwidth this machine
measures in the same run (a large tensor copied, read and written), as tokens/s; and the share
of it the engine reaches. Where the cache outweighs the weights, no decode of this model on
this machine keeps its short-completion rate.
"""

from __future__ import annotations

import argparse

import torch

from bench.report import Table, json_option, publish
from bench.timing import alternate, measure

STRIDED = "parity_strided"


def _register_strided() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from parity.models.attention import engine_attention

    def strided(module, query, key, value, attention_mask, parity_kv_len=None, **kw):
        if parity_kv_len is not None:   # slice here, so engine_attention never copies
            key, value = key[:, :, :parity_kv_len], value[:, :, :parity_kv_len]
            if attention_mask is not None:
                attention_mask = attention_mask[..., :parity_kv_len]
        return engine_attention(module, query, key, value, attention_mask, **kw)
    AttentionInterface.register(STRIDED, strided)
    AttentionMaskInterface.register(STRIDED, eager_mask)


def copy_bandwidth(gib: float = 1.0, reps: int = 3) -> float:
    """Bytes per second moved by copying a large tensor (each byte read once, written once)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / measure(lambda: dst.copy_(src), warmup=0, repeats=reps).min


def floor_rate(model, dtype_bytes: int, rows: int, prompt_len: float, n: int,
               bandwidth: float) -> float:
    """Completion tokens/s if decoding n tokens did nothing but read, at `bandwidth`, the
    weights once per step and each row's keys and values up to its position."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    weights = sum(p.numel() for p in model.parameters()) * dtype_bytes   # tied: counted once
    kv_per_position = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    cache = rows * kv_per_position * (n * prompt_len + n * (n + 1) / 2)   # summed over steps
    return rows * n * bandwidth / (n * weights + cache)


def breakdown(engine, rows: int, lengths: list[int], title: str, steps: int = 5,
              chunk: int = 256) -> Table:
    """Per decode step at each filled length: tokens/s and where the time goes."""
    from torch.profiler import profile
    from transformers import StaticCache

    from parity.logprobs import keep_last
    model, kw = engine.model, engine.cache_kw
    t = Table("breakdown", title + ", single decode steps at each cache length",
              [("cache length", "{}"), ("step ms", "{:.1f}"), ("tokens/s", "{:.0f}"),
               ("weights' products ms", "{:.1f}"), ("attention's products ms", "{:.1f}"),
               ("copies ms", "{:.1f}"), ("rest ms", "{:.1f}")])
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, model.config.vocab_size, (rows, L + 2 * steps + 4), generator=g)
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1])
        mask, scratch = torch.ones_like(ids), {}
        pos = torch.arange(ids.shape[1]).expand(rows, -1)
        with torch.no_grad():
            def run(a: int, b: int, ids=ids, mask=mask, pos=pos, cache=cache,
                    scratch=scratch) -> None:
                model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b],
                      **{kw: cache}, use_cache=True, logits_to_keep=keep_last(b - a, 1),
                      parity_kv_len=b, parity_scratch=scratch)
            for a in range(0, L, chunk):
                run(a, min(a + chunk, L))
            run(L, L + 1)                       # a warm-up step
            at = iter(range(L + 1, L + 1 + steps))

            def step(at=at) -> None:
                i = next(at)
                run(i, i + 1)
            with profile() as p:
                took = measure(step, warmup=0, repeats=steps)
        # The profiler's figures are means over the steps, so the step's time is too.
        dt = took.mean
        ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in p.key_averages()}
        total = sum(ms.values())
        part = [ms.get(k, 0.0) for k in ("aten::mm", "aten::bmm", "aten::copy_")]
        # The profiler's own overhead inflates its total; its shares are scaled to the step's
        # time measured around it.
        part = [x * dt * 1e3 / total for x in part]
        rest = dt * 1e3 - sum(part)
        t.add(L, dt * 1e3, rows / dt, *part, rest)
        print(f"cache length {L}: {dt * 1e3:.1f} ms a step", flush=True)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--lengths", default="64,256,512,1024")
    ap.add_argument("--sides", default="eager,parity_eager",
                    help="attention implementations to time, in this order at each length")
    ap.add_argument("--breakdown", action="store_true",
                    help="time single decode steps at each cache length, split by operator")
    a = json_option(ap, "decode_length").parse_args()

    from parity import testbed
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models.attention import ENGINE_ATTENTION
    from parity.models.loading import load_policy
    from parity.tasks.data import text_prompts
    _register_strided()
    model, tok = load_policy(testbed.resolve_model(a.model))
    prompts = [tok(p)["input_ids"] for p in text_prompts(a.rows, seed=0)]
    engine = HFEngine(model, a.dtype, -1, tok.pad_token_id)   # -1: no row ever stops early
    title = (f"{a.model}, {a.dtype} engine, {a.rows} rows, prompts of {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens, {torch.get_num_threads()} threads")
    if a.breakdown:
        return publish("decode_length", [breakdown(engine, a.rows, [int(x) for x in
                                                                    a.lengths.split(",")],
                                                   title)], a)
    sides = a.sides.split(",")
    unknown = set(sides) - {"eager", ENGINE_ATTENTION, STRIDED}
    if unknown:
        ap.error(f"--sides: unknown {', '.join(sorted(unknown))} "
                 f"(eager, {ENGINE_ATTENTION}, {STRIDED})")
    both = len(sides) == 2
    bandwidth = None if both else copy_bandwidth()
    t = Table("decode_length", title + (f", copy bandwidth {bandwidth / 1e9:.1f} GB/s"
                                        if bandwidth else ""),
              [("new tokens", "{}")] + [(f"{x} tokens/s", "{:.0f}") for x in sides]
              + ([("ratio", "{:.2f}"), ("same tokens", None)] if both else
                 [("against the first", "{:.2f}"), ("memory floor tokens/s", "{:.0f}"),
                  ("share of the floor", "{:.2f}")]))
    first = None
    nbytes = torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16,
                          "fp32": torch.float32}[a.dtype]).bits // 8
    for n in map(int, a.lengths.split(",")):
        def generate(attn: str, n: int = n):
            engine.model.set_attn_implementation(attn)
            return engine.generate(prompts, n, Sampling(), torch.Generator().manual_seed(0))
        took = alternate({x: lambda x=x: generate(x) for x in sides}, warmup=0, repeats=1)
        out = {x: took[x].results[0] for x in sides}
        rate = {x: float(out[x].completion_mask.sum()) / took[x].median for x in sides}
        if both:
            same = torch.equal(*(out[x].completion_ids for x in sides))
            t.add(n, *(rate[x] for x in sides), rate[sides[1]] / rate[sides[0]], same)
        else:
            r = rate[sides[0]]
            first = first or r
            floor = floor_rate(engine.model, nbytes, a.rows,
                               sum(map(len, prompts)) / len(prompts), n, bandwidth)
            t.add(n, r, r / first, floor, r / floor)
        print(f"{n} new tokens: " + ", ".join(f"{x} {rate[x]:.0f} tokens/s" for x in sides),
              flush=True)
    publish("decode_length", [t], a)

if __name__ == "__main__":
    main()
