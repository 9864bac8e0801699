"""How every bench times a call: warm-up calls first, then repeats, each one between two
synchronizations of the device (a CUDA kernel runs after the Python that queued it returns, so
an unsynchronized clock would time the queueing), summarized by the median and the spread.

    t = measure(fn, warmup=1, repeats=5, device=dev)
    t.median, t.min, t.spread, t.results[-1]

`alternate` times several calls round by round (a, b, a, b, ...), so drift of a shared machine
hits each of them alike. `setup` runs before each call, outside the timed span, and hands its
result to the call (a decode timed without its prefill).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from parity.devices import synchronize

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call, in the order they ran, and what each call returned."""

    samples: tuple[float, ...]
    results: tuple[Any, ...] = ()

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """(max − min) / median: how far apart the repeats fell, as a share of the figure."""
        return (self.max - self.min) / self.median if self.median else 0.0


def _one(fn: Callable, setup: Callable | None, device: torch.device,
         clock: Callable[[], float]) -> tuple[float, Any]:
    args = () if setup is None else (setup(),)
    synchronize(device)
    t0 = clock()
    out = fn(*args)
    synchronize(device)
    return clock() - t0, out


def measure(fn: Callable, *, warmup: int = 1, repeats: int = 5, device: torch.device = CPU,
            setup: Callable | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """`warmup` untimed calls of `fn`, then `repeats` timed ones."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least one call must be timed")
    for _ in range(warmup):
        fn(*(() if setup is None else (setup(),)))
    runs = [_one(fn, setup, device, clock) for _ in range(repeats)]
    return Timing(tuple(t for t, _ in runs), tuple(r for _, r in runs))


def alternate(fns: Mapping[str, Callable], *, warmup: int = 1, repeats: int = 5,
              device: torch.device = CPU,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Each call of `fns` timed `repeats` times, one round after another in the mapping's order,
    after `warmup` rounds that are not timed."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least one call must be timed")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    runs: dict[str, list] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            runs[k].append(_one(fn, None, device, clock))
    return {k: Timing(tuple(t for t, _ in v), tuple(r for _, r in v)) for k, v in runs.items()}
