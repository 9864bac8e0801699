"""The trainer's forward and backward over one micro-batch at Qwen3's vocabulary, scored whole
(`logprob_chunk -1`: one [tokens, vocabulary] logits tensor) against chunks of tokens, side by
side.

    python -m bench.logprob_chunks [--model qwen3-narrow-shape] [--rows 8] [--length 448]

`score_full` with gradient, then the backward of the log-probs' sum, on the testbed model with
Qwen3's 151,936-token vocabulary (a 2-layer body, so the head and the log-softmax are most of
the work, as they are of a real model's scoring at long completions), fp32 and under bf16
autocast. Chunk sizes alternate call by call; the table gives the median, the fp32 logits one
chunk holds, and the tokens whose logits the backward keeps rather than recomputes. 0 is parity's
default (parity/logprobs/scoring.py: chunks of HEAD_CHUNK_BYTES, the first KEPT_LOGITS_BYTES of
them kept); a chunk named (the default's size among them) recomputes every chunk.
"""

from __future__ import annotations

import argparse

import torch

from bench.report import Table, json_option, publish
from bench.timing import alternate
from parity import testbed
from parity.logprobs import Rollout, Sampling, head_chunk, kept_tokens
from parity.models.forward import WHOLE, score_full
from parity.models.loading import load_policy
from parity.models.precision import autocast

DEFAULT_SIZE = "default size"   # the default's chunk named, so that every chunk is recomputed
CHUNKS = (WHOLE, 16, 64, DEFAULT_SIZE, 0, 512)


def rollout(vocab: int, rows: int, length: int, prompt: int = 16) -> Rollout:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(5, vocab, (rows, n), generator=g)
    return Rollout(ids(prompt), torch.ones(rows, prompt, dtype=torch.long), ids(length),
                   torch.ones(rows, length), torch.zeros(rows, length),
                   torch.zeros(rows, dtype=torch.bool))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-narrow-shape")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=3)
    args = json_option(ap, "logprob_chunks").parse_args()
    model, _ = load_policy(testbed.ensure(args.model))
    vocab = model.config.vocab_size
    r = rollout(vocab, args.rows, args.length)
    t = Table("logprob_chunks", f"score_full + backward on {args.model} (vocabulary {vocab:,}), "
                                f"{args.rows} x {args.length} tokens, median of {args.repeats} (s)",
              [("trainer", None), ("logprob_chunk", "{}"), ("tokens a chunk", "{}"),
               ("fp32 logits a chunk MiB", "{:.0f}"), ("tokens kept", "{}"),
               ("forward + backward s", "{:.2f}"), ("vs whole", "{:.2f}x")])
    whole = args.rows * (args.length + 1)
    size = {c: whole if c == WHOLE else min(c if isinstance(c, int) and c else head_chunk(vocab),
                                            whole) for c in CHUNKS}
    for dtype in ("fp32", "bf16"):
        def step(chunk: int, dtype: str = dtype) -> None:
            model.zero_grad(set_to_none=True)
            with autocast(dtype, torch.device("cpu")):
                logp = score_full(model, r, Sampling(), chunk=size[chunk] if chunk ==
                                  DEFAULT_SIZE else chunk).logp
            logp.sum().backward()
        med = {c: v.median for c, v in alternate(
            {c: (lambda c=c: step(c)) for c in CHUNKS}, warmup=1, repeats=args.repeats).items()}
        for c in CHUNKS:
            kept = whole if c == WHOLE else min(kept_tokens(vocab), whole) if c == 0 else 0
            t.add(dtype, f"{size[c]} (named)" if c == DEFAULT_SIZE else c, size[c],
                  size[c] * vocab * 4 / 2**20, kept, med[c], med[c] / med[WHOLE])
    publish("logprob_chunks", [t], args)


if __name__ == "__main__":
    main()
