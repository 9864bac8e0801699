"""`logits_to_keep` as an int against an index tensor (engines.keep_last), side by side.

    python bench/logits_to_keep.py [--model LARGEST] [--batch 64] [--repeats 5]

An int makes transformers slice the hidden states into a strided view; with a head weight that
does not require grad (the engine's and the shadow's copies), torch's matmul then takes the
batched path and copies the head's weight once per row. The index tensor gives a contiguous
copy. Times one engine prefill (keep the last position) and one scoring forward (keep 25
positions) of the same batch on the engine's own low-precision copy, in fp32 and bf16,
alternating the two forms; prints the median of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import testbed  # noqa: E402
from parity.engines import keep_last, positions  # noqa: E402
from parity.precision import low_precision_copy  # noqa: E402
from parity.runs import load_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    master, _ = load_policy(testbed.ensure(args.model))
    g = torch.Generator().manual_seed(0)
    t = Table(title=f"logits_to_keep on {args.model}, batch {args.batch}, median of "
                    f"{args.repeats} (s)")
    for col in ("dtype", "forward", "positions", "kept", "int", "index tensor", "int / index"):
        t.add_column(col, justify="left" if col in ("dtype", "forward") else "right")
    for dtype in ("fp32", "bf16"):
        model = low_precision_copy(master, dtype)  # as HFEngine and Shadow hold it
        for name, length, kept in (("prefill", 12, 1), ("score", 36, 25)):
            ids = torch.randint(5, model.config.vocab_size, (args.batch, length), generator=g)
            mask = torch.ones_like(ids)
            forms = {"int": kept, "index": keep_last(length, kept)}
            times: dict[str, list[float]] = {k: [] for k in forms}
            with torch.no_grad():
                for _ in range(args.repeats + 1):  # the first round warms up
                    for k, keep in forms.items():
                        t0 = time.perf_counter()
                        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                              use_cache=False, logits_to_keep=keep)
                        times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            t.add_row(dtype, name, str(length), str(kept),
                      f"{med['int']:.4f}", f"{med['index']:.4f}", f"{med['int'] / med['index']:.2f}x")
    Console(width=120).print(t)


if __name__ == "__main__":
    main()
