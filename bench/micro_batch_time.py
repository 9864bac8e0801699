"""What micro-batches cost in update time: the trainer's forward and backward over one
minibatch at once against the same minibatch in micro-batches, alternated in one process.

    python -m bench.micro_batch_time                                 # testbed `text`
    python -m bench.micro_batch_time --model smollm2-135m --rows 64 --tokens 64 --micro 8

The completions are sampled once by parity's engine (fp32, neg-length prompts, the lengths the
model gives them); each round then runs the unbatched update and the micro-batched one
(`parity.models.forward.pieces` / `trimmed`, each piece's loss scaled by its share, as the trainer
does) on the same weights, and the AdamW step after it, after one untimed round of both.
Alternating puts drift of a shared machine on both sides; the table gives each round and the
median ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.report import Table, json_option, publish
from bench.timing import alternate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="text")
    ap.add_argument("--rows", type=int, default=64, help="completions in the minibatch")
    ap.add_argument("--tokens", type=int, default=64, help="max tokens per completion")
    ap.add_argument("--micro", type=int, default=8, help="completions per micro-batch")
    ap.add_argument("--chunk", type=int, default=0, help="logprob_chunk on the micro side")
    ap.add_argument("--rounds", type=int, default=3)
    a = json_option(ap, "micro_batch_time").parse_args()

    from parity import testbed
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models.forward import pieces, score_full, trimmed
    from parity.models.loading import load_policy
    from parity.tasks.data import text_prompts
    model, tok = load_policy(testbed.resolve_model(a.model))
    prompts = [tok(p)["input_ids"] for p in text_prompts(a.rows, seed=0)]
    r = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        prompts, a.tokens, Sampling(), torch.Generator().manual_seed(0))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
    s, B = Sampling(), r.completion_ids.shape[0]
    n_tok = float(r.completion_mask.sum())

    def update(micro: int) -> None:
        for sl in pieces(r, rows=micro) if micro else [slice(0, B)]:
            piece = trimmed(r.select(sl)) if micro else r
            logp = score_full(model, piece, s, chunk=a.chunk if micro else 0).logp
            (logp.sum() / n_tok).backward()  # a token mean: each piece's share of it
        opt.step()
        opt.zero_grad(set_to_none=True)

    # the warm-up round: allocator, first-call kernels
    took = alternate({"whole": lambda: update(0), "micro": lambda: update(a.micro)}, warmup=1,
                     repeats=a.rounds)
    lens = r.completion_mask.sum(-1)
    t = Table("micro_batch_time",
              f"{a.model}: {B} completions, mean {lens.mean():.0f} / max {lens.max():.0f} "
              f"tokens; micro-batches of {a.micro}"
              f"{f', logprob_chunk {a.chunk}' if a.chunk else ''}",
              [("round", "{}"), ("whole s", "{:.2f}"), ("micro s", "{:.2f}"),
               ("micro / whole", "{:.3f}")])
    ratios = []
    for i, (w, m) in enumerate(zip(took["whole"].samples, took["micro"].samples)):
        ratios.append(m / w)
        t.add(i + 1, w, m, m / w)
    t.notes.append(f"median micro / whole: {statistics.median(ratios):.3f}")
    publish("micro_batch_time", [t], a)


if __name__ == "__main__":
    main()
