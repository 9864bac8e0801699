"""The engine's decode throughput against completion length: transformers' eager attention
against parity's (`parity.engines.engine_attention`), alternated in one process.

    python bench/decode_length.py                                   # smollm2-135m, bf16
    python bench/decode_length.py --model text --lengths 64,256 --rows 16
    python bench/decode_length.py --sides parity_eager --lengths 64,256,512,1024,2048

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
import time

import torch


STRIDED = "parity_strided"


def _register_strided() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from parity.engines.attention import engine_attention

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
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


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


def breakdown(engine, rows: int, lengths: list[int], steps: int = 5, chunk: int = 256) -> None:
    """Per decode step at each filled length: tokens/s and where the time goes."""
    from torch.profiler import profile
    from transformers import StaticCache

    from parity.engines import keep_last
    model, kw = engine.model, engine.cache_kw
    print("| cache length | step ms | tokens/s | weights' products ms | attention's products ms"
          " | copies ms | rest ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, model.config.vocab_size, (rows, L + 2 * steps + 4), generator=g)
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1])
        mask, scratch = torch.ones_like(ids), {}
        pos = torch.arange(ids.shape[1]).expand(rows, -1)
        with torch.no_grad():
            def run(a: int, b: int) -> None:
                model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b],
                      **{kw: cache}, use_cache=True, logits_to_keep=keep_last(b - a, 1),
                      parity_kv_len=b, parity_scratch=scratch)
            for a in range(0, L, chunk):
                run(a, min(a + chunk, L))
            run(L, L + 1)                       # a warm-up step
            with profile() as p:
                t0 = time.perf_counter()
                for i in range(steps):
                    run(L + 1 + i, L + 2 + i)
                dt = (time.perf_counter() - t0) / steps
        ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in p.key_averages()}
        total = sum(ms.values())
        part = [ms.get(k, 0.0) for k in ("aten::mm", "aten::bmm", "aten::copy_")]
        # The profiler's own overhead inflates its total; its shares are scaled to the step's
        # time measured around it.
        part = [x * dt * 1e3 / total for x in part]
        rest = dt * 1e3 - sum(part)
        print(f"| {L} | {dt * 1e3:.1f} | {rows / dt:.0f} | "
              + " | ".join(f"{x:.1f}" for x in (*part, rest)) + " |", flush=True)


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
    a = ap.parse_args()

    from parity import testbed
    from parity.engines.attention import ENGINE_ATTENTION
    from parity.engines.hf import HFEngine
    from parity.engines import Sampling
    _register_strided()
    from parity.runs import load_policy
    model, tok = load_policy(testbed.resolve_model(a.model))
    prompts = [tok(p)["input_ids"] for p in testbed.text_prompts(a.rows, seed=0)]
    engine = HFEngine(model, a.dtype, -1, tok.pad_token_id)   # -1: no row ever stops early
    print(f"{a.model}, {a.dtype} engine, {a.rows} rows, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {torch.get_num_threads()} threads\n")
    if a.breakdown:
        return breakdown(engine, a.rows, [int(x) for x in a.lengths.split(",")])
    sides = a.sides.split(",")
    unknown = set(sides) - {"eager", ENGINE_ATTENTION, STRIDED}
    if unknown:
        ap.error(f"--sides: unknown {', '.join(sorted(unknown))} "
                 f"(eager, {ENGINE_ATTENTION}, {STRIDED})")
    both = len(sides) == 2
    bandwidth = None if both else copy_bandwidth()
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s\n")
    print("| new tokens | " + " | ".join(f"{x} tokens/s" for x in sides)
          + (" | ratio | same tokens |" if both else
             " | against the first | memory floor tokens/s | share of the floor |"))
    print("|---:|" + "---:|" * len(sides) + ("---:|---|" if both else "---:|---:|---:|"))
    first = None
    nbytes = torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16,
                          "fp32": torch.float32}[a.dtype]).bits // 8
    for n in map(int, a.lengths.split(",")):
        rate, out = {}, {}
        for attn in sides:
            engine.model.set_attn_implementation(attn)
            t0 = time.perf_counter()
            out[attn] = engine.generate(prompts, n, Sampling(), torch.Generator().manual_seed(0))
            rate[attn] = float(out[attn].completion_mask.sum()) / (time.perf_counter() - t0)
        line = f"| {n} | " + " | ".join(f"{rate[x]:.0f}" for x in sides)
        if both:
            same = torch.equal(*(out[x].completion_ids for x in sides))
            line += f" | {rate[sides[1]] / rate[sides[0]]:.2f} | {'yes' if same else 'no'}"
        else:
            r = rate[sides[0]]
            first = first or r
            floor = floor_rate(engine.model, nbytes, a.rows,
                               sum(map(len, prompts)) / len(prompts), n, bandwidth)
            line += f" | {r / first:.2f} | {floor:.0f} | {r / floor:.2f}"
        print(line + " |", flush=True)


if __name__ == "__main__":
    main()
