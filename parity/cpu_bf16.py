"""bf16 matrix products on a CPU without bf16 instructions: emulated with fp32 kernels.

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
_library: torch.library.Library | None = None


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
    return _library is not None


# Each override computes a bf16 product in fp32 and calls the `out=` overload for the product
# itself: that overload is another aten operator, whose kernel stays torch's own, so the
# override never calls itself. Other dtypes go the same way into a fresh output, which is what
# the functional kernel does.

def _out(a: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return a.new_empty(shape, dtype=_F32 if a.dtype is _BF16 else a.dtype)


def _mm(a, b):
    out = _out(a, (a.shape[0], b.shape[1]))
    if a.dtype is not _BF16:
        return torch.mm(a, b, out=out)
    return torch.mm(a.float(), b.float(), out=out).to(_BF16)


def _bmm(a, b):
    out = _out(a, (a.shape[0], a.shape[1], b.shape[2]))
    if a.dtype is not _BF16:
        return torch.bmm(a, b, out=out)
    return torch.bmm(a.float(), b.float(), out=out).to(_BF16)


def _addmm(c, a, b, *, beta=1, alpha=1):
    out = _out(a, (a.shape[0], b.shape[1]))
    if a.dtype is not _BF16:
        return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)
    return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha,
                       out=out).to(_BF16)


def _baddbmm(c, a, b, *, beta=1, alpha=1):
    out = _out(a, (a.shape[0], a.shape[1], b.shape[2]))
    if a.dtype is not _BF16:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha,
                         out=out).to(_BF16)


_OVERRIDES = {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm}


def _install() -> None:
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        for name, fn in _OVERRIDES.items():
            lib.impl(name, fn, "CPU")
    _library = lib


def _uninstall() -> None:
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def install(value: str | None = None) -> bool:
    """Emulate bf16 products in this process if `value` (the environment's setting by
    default) asks for it here; leave torch's kernels otherwise. Returns whether it is active.
    Idempotent: every command calls it when it resolves its device."""
    if wanted(value):
        _install()
    return active()


@contextlib.contextmanager
def kernels(emulate: bool) -> Iterator[None]:
    """Within the block, bf16 products run emulated (`emulate`) or natively, whatever the
    process had; restored after it (the tests and benches compare the two side by side)."""
    was = active()
    _install() if emulate else _uninstall()
    try:
        yield
    finally:
        _install() if was else _uninstall()


def describe() -> str:
    """The path bf16 products take here, in words (run headers, benchmark tables)."""
    if active():
        return "bf16 products emulated with fp32 kernels"
    if has_bf16_instructions():
        return "bf16 products native"
    return f"bf16 products native (slow here: no bf16 instructions; {ENV}=auto emulates them)"
