"""parity's overrides of aten's CPU matrix products: bf16 products emulated with fp32 kernels on
a CPU without bf16 instructions, and rows padded to a fixed tile for the invariant kernels
(parity/models/invariant.py). One set of overrides does both, as either asks.

torch's bf16 GEMMs are fast only where the CPU has bf16 instructions (AVX512-BF16, AMX). On
the others (AVX2-only laptops and servers, AVX-512 without BF16) they take a slow path: with
AVX2's kernels a 512 x 512 product ran 0.7 GFLOP/s in bf16 against 142 in fp32 (`python -m
bench.bf16_cpu`, docs/performance.md). Every bf16 compute in
parity meets them: the engine's and the shadow's bf16 copies, the trainer under bf16
autocast, the testbed's build.

A bf16 product with fp32 accumulation, which is what the native kernels compute, is an fp32
product of the bf16 values rounded to bf16 at the end: a product of two bf16 numbers (8
significant bits each) is exact in fp32 (24 bits). So the emulation casts the bf16 operands to
fp32, runs torch's fp32 kernel and rounds the result to bf16. Only the order of the fp32 sums
differs from a native kernel's, as it differs between two native kernels: a result lands on
the other side of a bf16 rounding boundary rarely, by one ulp (tests/test_cpu_bf16.py holds
both within one ulp of a float64 reference, differing in under 0.5% of results).

It is installed once per process, as overrides of aten's CPU kernels for mm, addmm, bmm and
baddbmm (`torch.library`), so autograd's backward products take it too, and nothing is copied
per model. Attention keeps torch's own bf16 kernel (SDPA), which no bench here has priced on
such CPUs. The `PARITY_CPU_BF16` environment variable chooses: `auto` (the default: emulate
where the CPU lacks bf16 instructions), `native` or `emulate`.

Padded (`pad_rows`), a product's rows are made a multiple of a tile with zero rows before the
kernel runs: a BLAS picks its kernel, and so the order of its sums, by the shape, and a few
rows take another one than many (docs/zero-mismatch.md). The added term of addmm and baddbmm
is then added to the rounded product, never inside the kernel, which fuses it at some row
counts only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import warnings
from collections.abc import Iterator

import torch

from parity.errors import ParityError

ENV = "PARITY_CPU_BF16"
SETTINGS = ("auto", "native", "emulate")

# oneDNN's instruction sets without bf16 arithmetic: ONEDNN_MAX_CPU_ISA at one of these keeps
# torch's bf16 products off the instructions the CPU has (how a CPU with AMX runs an AVX2-only
# CPU's kernels: CONTRIBUTING.md).
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_BF16, _F32 = torch.bfloat16, torch.float32
_LOW = (torch.bfloat16, torch.float16)
CHUNK = 128   # rows of each kernel call of a padded matrix product
_library: torch.library.Library | None = None
_emulate = False
_tile = 0
_batched_one_call = True   # an fp32 batched product padded to the tile holds: set with the tile


def has_bf16_instructions() -> bool:
    """Whether torch's native bf16 GEMMs have instructions to run on: AVX512-BF16 or AMX on
    x86, unless ONEDNN_MAX_CPU_ISA keeps oneDNN off them. Elsewhere (ARM) torch's own kernels
    are kept: nothing here measured them."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _NO_BF16_ISAS:
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def setting() -> str:
    """The `PARITY_CPU_BF16` setting, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in SETTINGS:
        raise ParityError(f"{ENV}={value!r} must be one of: {', '.join(SETTINGS)}")
    return value


def wanted(value: str | None = None) -> bool:
    """Whether `value` (the environment's setting by default) asks for the emulation here."""
    value = setting() if value is None else value
    return value == "emulate" or (value == "auto" and not has_bf16_instructions())


def active() -> bool:
    """bf16 products are emulated in this process."""
    return _emulate


def padding() -> int:
    """The multiple a product's rows are padded to in this process (0: none)."""
    return _tile


# Each override computes the product and calls the `out=` overload for it: that overload is
# another aten operator, whose kernel stays torch's own, so the override never calls itself.
# Emulated, a bf16 product runs in fp32 and is rounded to bf16 once; other dtypes go the same
# way into a fresh output, which is what the functional kernel does. Padded (the invariant
# kernels: parity/models/invariant.py), a product runs in calls of a fixed number of rows
# (`_step`), the rows of `a` filled up with zero rows, and the result's own rows are returned.

def _emulated(a: torch.Tensor) -> bool:
    return _emulate and a.dtype is _BF16


def _step(a: torch.Tensor, batched: bool) -> int:
    """Rows per kernel call when padded. A matrix product (mm, addmm) runs as calls of CHUNK
    rows each, so every call has one shape: a BLAS picks its blocking, and so the order of its
    sums, by the row count at any multiple of the tile (oneDNN's native bf16 kernels on a CPU
    with AMX; MKL's fp32 ones over two threads at K 1536: `python -m bench.row_invariance`).
    A native low-precision batched product likewise, one matrix at a time, since its kernel
    picks by the batch count too. An fp32 batched product (attention's scores and weighted
    sums, K a head's width) is one call padded to the tile where the CPU has bf16
    instructions, which that bench finds holds there; with AVX2's kernels it does not (31 and
    32 rows of 64 differ), so there it too runs a matrix at a time."""
    if not batched or (a.dtype in _LOW and not _emulated(a)) or not _batched_one_call:
        return CHUNK
    return _tile


def _rows(a: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """`a` with zero rows appended along `dim` (1: a batched product) up to a multiple of its
    step; its own rows."""
    m = a.shape[dim]
    step = _step(a, dim == 1) if _tile else 0
    extra = -m % step if step and m else 0
    if not extra:
        return a, m
    pad = [0, 0] * (a.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(a, pad), m


def _result(out: torch.Tensor, m: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    out = out if out.shape[dim] == m else out.narrow(dim, 0, m).contiguous()
    return out.to(dtype) if out.dtype is not dtype else out


def _calls(n: int, step: int) -> list[slice]:
    """The row slices of the kernel calls over `n` rows, `step` rows each."""
    return [slice(i, i + step) for i in range(0, n, step or 1)] or [slice(0, 0)]


def _mm(a, b):
    dtype, (a, m) = a.dtype, _rows(a, 0)
    wide = _emulated(a)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=_F32 if wide else dtype)
    a, b = (a.float(), b.float()) if wide else (a, b)
    for rows in _calls(a.shape[0], CHUNK if _tile else a.shape[0]):
        torch.mm(a[rows], b, out=out[rows])
    return _result(out, m, 0, dtype)


def _bmm(a, b):
    dtype, (a, m) = a.dtype, _rows(a, 1)
    one_by_one = _tile and _step(a, True) == CHUNK
    wide = _emulated(a)
    a, b = (a.float(), b.float()) if wide else (a, b)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype)
    if one_by_one:
        for j in range(a.shape[0]):
            for rows in _calls(a.shape[1], CHUNK):
                torch.mm(a[j, rows], b[j], out=out[j, rows])
    else:
        torch.bmm(a, b, out=out)
    return _result(out, m, 1, dtype)


def _added(c, prod, beta, alpha):
    """beta·c + alpha·prod, elementwise, in the product's dtype. Padded, the added term is
    added after the product rather than inside the kernel: a BLAS fuses it into the sum at
    some row counts and adds it to the rounded product at others (oneDNN on a CPU with AMX)."""
    c = c.to(prod.dtype)
    prod = prod if alpha == 1 else prod * alpha
    return prod + (c if beta == 1 else c * beta) if beta != 0 else prod


def _addmm(c, a, b, *, beta=1, alpha=1):
    if _tile:
        return _added(c, _mm(a, b), beta, alpha)
    dtype, wide = a.dtype, _emulated(a)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=_F32 if wide else dtype)
    f = (lambda t: t.float()) if wide else (lambda t: t)
    torch.addmm(f(c), f(a), f(b), beta=beta, alpha=alpha, out=out)
    return _result(out, a.shape[0], 0, dtype)


def _baddbmm(c, a, b, *, beta=1, alpha=1):
    if _tile:
        return _added(c, _bmm(a, b), beta, alpha)
    dtype, wide = a.dtype, _emulated(a)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=_F32 if wide else dtype)
    f = (lambda t: t.float()) if wide else (lambda t: t)
    torch.baddbmm(f(c), f(a), f(b), beta=beta, alpha=alpha, out=out)
    return _result(out, a.shape[1], 1, dtype)


_OVERRIDES = {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm}


def _set(emulate: bool, tile: int) -> None:
    """Install the overrides where either is asked for, remove them where neither is."""
    global _library, _emulate, _tile, _batched_one_call
    _emulate, _tile = emulate, tile
    _batched_one_call = has_bf16_instructions()
    if (emulate or tile) and _library is None:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that a kernel is overridden: the point
            warnings.simplefilter("ignore")
            for name, fn in _OVERRIDES.items():
                lib.impl(name, fn, "CPU")
        _library = lib
    elif not (emulate or tile) and _library is not None:
        _library._destroy()
        _library = None


def install(value: str | None = None) -> bool:
    """Emulate bf16 products in this process if `value` (the environment's setting by
    default) asks for it here; leave torch's kernels otherwise. Returns whether it is active.
    Idempotent: every command calls it when it resolves its device."""
    if wanted(value):
        _set(True, _tile)
    return active()


def install_for(device: torch.device) -> bool:
    """`install` for work whose products run on `device`: on the CPU only (a trainer that
    resolves its device itself, as TRL's do through accelerate)."""
    return device.type == "cpu" and install()


def state() -> tuple[bool, int]:
    """This process's bf16 path and row padding, for another process to take (`set_state`)."""
    return _emulate, _tile


def set_state(kept: tuple[bool, int]) -> None:
    """Products as `state()` found them in another process: an engine process computes what
    the trainer's would."""
    _set(*kept)


def pad_rows(tile: int) -> None:
    """Pad every CPU product's rows to a multiple of `tile` in this process (0: stop)."""
    _set(_emulate, tile)


@contextlib.contextmanager
def kernels(emulate: bool, tile: int | None = None) -> Iterator[None]:
    """Within the block, bf16 products run emulated (`emulate`) or natively, and rows are
    padded to `tile` (None: as the process had), whatever the process had; restored after it
    (the tests and benches compare the two side by side)."""
    was = (_emulate, _tile)
    _set(emulate, was[1] if tile is None else tile)
    try:
        yield
    finally:
        _set(*was)


def restored() -> contextlib.AbstractContextManager[None]:
    """Within the block a run may pad products or emulate (`kernels=invariant` pads them for
    the process); after it, the process's kernels are what they were (a library caller's next
    work in the same process is not padded by the last run's recipe)."""
    return kernels(_emulate, None)


def describe() -> str:
    """The path bf16 products take here, in words (run headers, benchmark tables)."""
    if active():
        return "bf16 products emulated with fp32 kernels"
    if has_bf16_instructions():
        return "bf16 products native"
    return f"bf16 products native (slow here: no bf16 instructions; {ENV}=auto emulates them)"
