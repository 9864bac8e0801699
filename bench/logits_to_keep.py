"""`logits_to_keep` as an int against an index tensor (engines.keep_last), side by side.

    python -m bench.logits_to_keep [--model LARGEST] [--batch 64] [--repeats 5]

An int makes transformers slice the hidden states into a strided view; with a head weight that
does not require grad (the engine's and the shadow's copies), torch's matmul then takes the
batched path and copies the head's weight once per row. The index tensor gives a contiguous
copy. Times one engine prefill (keep the last position) and one scoring forward (keep 25
positions) of the same batch on the engine's own low-precision copy, in fp32 and bf16,
alternating the two forms; prints the median of each.
"""

from __future__ import annotations

import argparse

import torch

from bench.report import Table, json_option, publish
from bench.timing import alternate
from parity import testbed
from parity.logprobs import keep_last, positions
from parity.models.loading import load_policy
from parity.models.precision import low_precision_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = json_option(ap, "logits_to_keep").parse_args()
    master, _ = load_policy(testbed.ensure(args.model))
    g = torch.Generator().manual_seed(0)
    t = Table("logits_to_keep", f"logits_to_keep on {args.model}, batch {args.batch}, median of "
                                f"{args.repeats} (s)",
              [("dtype", None), ("forward", None), ("positions", "{}"), ("kept", "{}"),
               ("int", "{:.4f}"), ("index tensor", "{:.4f}"), ("int / index", "{:.2f}x")])
    for dtype in ("fp32", "bf16"):
        model = low_precision_copy(master, dtype)  # as HFEngine and Shadow hold it
        for name, length, kept in (("prefill", 12, 1), ("score", 36, 25)):
            ids = torch.randint(5, model.config.vocab_size, (args.batch, length), generator=g)
            mask, index = torch.ones_like(ids), keep_last(length, kept)

            def forward(keep, model=model, ids=ids, mask=mask):
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                          use_cache=False, logits_to_keep=keep)
            med = {k: v.median for k, v in alternate(
                {"int": lambda kept=kept: forward(kept),
                 "index": lambda index=index: forward(index)},
                warmup=1, repeats=args.repeats).items()}
            t.add(dtype, name, length, kept, med["int"], med["index"], med["int"] / med["index"])
    publish("logits_to_keep", [t], args)

if __name__ == "__main__":
    main()
