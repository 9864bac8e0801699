"""Which of this CPU's kernels give a row the same bits whatever the number of rows beside it:
each op on the first m rows of a 64-row batch, m = 1..64, against the same rows of the whole
batch, in one and two threads, with and without parity's row padding (docs/zero-mismatch.md).

    python -m bench.row_invariance [--json docs/data/bench/row_invariance.json]

A row count is listed where any of its rows differs at all (torch.equal). Kernels differ between
CPUs (AMX or not, AVX-512 or AVX2 alone), so the table is this machine's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.report import Table, json_option, publish
from parity import cpu_bf16
from parity.logprobs.scoring import logsumexp
from parity.models import invariant

ROWS = 64


def _ops() -> list[tuple[str, torch.dtype, int, object]]:
    g = torch.Generator().manual_seed(0)
    w = {dt: torch.randn(1536, 576, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16)}
    return [("F.linear (576 -> 1536)", dt, 576, lambda x, w=w[dt]: F.linear(x, w))
            for dt in (torch.float32, torch.bfloat16)] + [
        ("log_softmax", torch.float32, 151936, lambda x: torch.log_softmax(x, -1)),
        ("logsumexp", torch.float32, 151936, lambda x: torch.logsumexp(x, -1)),
        ("parity's logsumexp (parity/logprobs/scoring.py)", torch.float32, 151936, logsumexp),
        ("mean of squares (RMSNorm)", torch.float32, 576, lambda x: x.pow(2).mean(-1)),
        ("mean of squares (RMSNorm)", torch.bfloat16, 576, lambda x: x.pow(2).mean(-1)),
        ("sum", torch.float32, 151936, lambda x: x.sum(-1))]


def differing(fn, x: torch.Tensor) -> list[int]:
    whole = fn(x)
    return [m for m in range(1, ROWS + 1) if not torch.equal(fn(x[:m].clone()), whole[:m])]


def _counts(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:12])) + (f" ... ({len(rows)})" if len(rows) > 12 else "") \
        if rows else "none"


def table() -> Table:
    t = Table("row_invariance",
              f"the row counts m (of 1..{ROWS}) at which an op on m rows gives any row other "
              f"bits than the {ROWS}-row batch does; padded: rows padded to "
              f"{invariant.TILE} (kernels=invariant)",
              [("op", None), ("dtype", None), ("width", "{}"), ("threads", "{}"),
               ("own kernels", None), ("padded", None)])
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    try:
        for name, dtype, width, fn in _ops():
            x = (torch.randn(ROWS, width, generator=g) * 3).to(dtype)
            for n in (1, 2):
                torch.set_num_threads(n)
                with cpu_bf16.kernels(emulate=cpu_bf16.active(), tile=0):
                    own = differing(fn, x)
                with cpu_bf16.kernels(emulate=cpu_bf16.active(), tile=invariant.TILE):
                    padded = differing(fn, x)
                t.add(name, str(dtype).removeprefix("torch."), width, n, _counts(own),
                      _counts(padded))
    finally:
        torch.set_num_threads(threads)
    t.notes.append(f"bf16 products: {cpu_bf16.describe()}; the padding pads matrix products "
                   f"only, so the other ops' two columns are the same kernels")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = json_option(ap, "row_invariance").parse_args()
    cpu_bf16.install()
    publish("row_invariance", [table()], a)


if __name__ == "__main__":
    main()
