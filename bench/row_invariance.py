"""Which of this CPU's kernels give a row the same bits whatever the number of rows beside it:
each op on the first m rows of a batch (64 rows; 512 for the products, m = 1..64 then every
16th), against the same rows of the whole batch, in one and two threads, with and without
parity's invariant kernels (docs/zero-mismatch.md). The batched product's m counts matrices.

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

ROWS, PRODUCT_ROWS, BATCH = 64, 512, 8
_DTYPES = (torch.float32, torch.bfloat16)


def _ops() -> list[tuple[str, torch.dtype, tuple[int, ...], object]]:
    """(name, dtype, the batch's shape, op)."""
    g = torch.Generator().manual_seed(0)
    w = {(o, i, dt): torch.randn(o, i, generator=g).to(dt)
         for o, i in ((1536, 576), (576, 1536)) for dt in _DTYPES}
    wb = {dt: torch.randn(BATCH, 1536, 576, generator=g).to(dt) for dt in _DTYPES}
    keys = torch.randn(2 * BATCH, 64, 64, generator=g)    # a block of 64 keys, a 64-wide head
    return [(f"F.linear ({i} -> {o})", dt, (PRODUCT_ROWS, i),
             lambda x, w=w[o, i, dt]: F.linear(x, w))
            for o, i in ((1536, 576), (576, 1536)) for dt in _DTYPES] + [
        ("bmm (m matrices of 300 x 1536 by 1536 x 576)", dt, (BATCH, 300, 1536),
         lambda x, w=wb[dt]: torch.bmm(x, w[:x.shape[0]])) for dt in _DTYPES] + [
        # parity's invariant attention: fp32 scores of (query, head) rows against a key block
        ("attention's scores, m query rows (bmm of 16 x m x 64 by 64 x 64)", torch.float32,
         (PRODUCT_ROWS, 2 * BATCH, 64),
         lambda x: torch.bmm(x.transpose(0, 1), keys).transpose(0, 1)),
        ("attention's scores, m matrices (bmm of m x 300 x 64 by 64 x 64)", torch.float32,
         (2 * BATCH, 300, 64), lambda x: torch.bmm(x, keys[:x.shape[0]]))] + [
        ("log_softmax", torch.float32, (ROWS, 151936), lambda x: torch.log_softmax(x, -1)),
        ("logsumexp", torch.float32, (ROWS, 151936), lambda x: torch.logsumexp(x, -1)),
        ("parity's logsumexp (parity/logprobs/scoring.py)", torch.float32, (ROWS, 151936),
         logsumexp),
        ("mean of squares (RMSNorm)", torch.float32, (ROWS, 576), lambda x: x.pow(2).mean(-1)),
        ("mean of squares (RMSNorm)", torch.bfloat16, (ROWS, 576), lambda x: x.pow(2).mean(-1)),
        ("sum", torch.float32, (ROWS, 151936), lambda x: x.sum(-1))]


def differing(fn, x: torch.Tensor) -> list[int]:
    whole, n = fn(x), x.shape[0]
    counts = [m for m in range(1, n + 1) if m <= ROWS or m % 16 == 0]
    return [m for m in counts if not torch.equal(fn(x[:m].clone()), whole[:m])]


def _counts(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:12])) + (f" ... ({len(rows)})" if len(rows) > 12 else "") \
        if rows else "none"


def table() -> Table:
    t = Table("row_invariance",
              f"the row counts m (1..{ROWS}, then multiples of 16) at which an op on m rows "
              f"gives any row other bits than the whole batch does (m matrices for bmm); "
              f"invariant: kernels=invariant's products (calls of {cpu_bf16.CHUNK} rows; a "
              f"native bf16 batch a matrix at a time, an fp32 one padded to "
              f"{invariant.TILE} rows where the CPU has bf16 instructions)",
              [("op", None), ("dtype", None), ("width", "{}"), ("threads", "{}"),
               ("own kernels", None), ("invariant", None)])
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    try:
        for name, dtype, shape, fn in _ops():
            x = (torch.randn(*shape, generator=g) * 3).to(dtype)
            for n in (1, 2):
                torch.set_num_threads(n)
                with cpu_bf16.kernels(emulate=cpu_bf16.active(), tile=0):
                    own = differing(fn, x)
                with cpu_bf16.kernels(emulate=cpu_bf16.active(), tile=invariant.TILE):
                    padded = differing(fn, x)
                t.add(name, str(dtype).removeprefix("torch."), shape[-1], n, _counts(own),
                      _counts(padded))
    finally:
        torch.set_num_threads(threads)
    t.notes.append(f"bf16 products: {cpu_bf16.describe()}; the invariant kernels change "
                   f"matrix products only, so the other ops' two columns are the same kernels")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = json_option(ap, "row_invariance").parse_args()
    cpu_bf16.install()
    publish("row_invariance", [table()], a)


if __name__ == "__main__":
    main()
