"""Multi-process training on torch.distributed: one process per rank, started by `torchrun` or
`accelerate launch`: gloo on CPU, NCCL with one GPU per rank (LOCAL_RANK: parity/devices.py).

Every rank holds the whole model (DDP) and samples its shard of each step's prompts. The shards
are cut so that a rank's part of every minibatch is a slice of the one-process minibatch, each
row draws the random number the one-process run draws for it, and a metric is computed on the
tokens of all ranks: a 2-process run gives the 1-process metrics (tests/test_distributed.py).

DDP averages gradients over ranks, which is the gradient of the global loss only when every
rank's loss has the same denominator. `Dist.sharer` rescales a rank's loss (or a micro-batch's)
to its part of the global one (token means, DPO pairs); rank 0 alone writes files.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as td

from parity.devices import backend
from parity.errors import ParityError, one_line

T = TypeVar("T")


class RankFailure(ParityError):
    """A collective with the other ranks failed: one of them stopped, or it timed out."""


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    # The rank's device: NCCL reduces tensors on the GPU, gloo on the CPU.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1

    # -- sharding ------------------------------------------------------------------------
    def shard(self, n_prompts: int, minibatches: int) -> list[int]:
        """Positions in the step's prompt list that this rank samples: its 1/world of every
        minibatch, so minibatch m of every rank together is the one-process minibatch m."""
        per_mb = n_prompts // minibatches
        per_rank = per_mb // self.world
        return [m * per_mb + self.rank * per_rank + j
                for m in range(minibatches) for j in range(per_rank)]

    # -- collectives (a failed one is a RankFailure, not a hang or a gloo traceback) -------
    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as e:
            raise RankFailure(failure_message(e)) from None

    def sum(self, x: float) -> float:
        if not self.on:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        self._call(lambda: td.all_reduce(t))
        return float(t)

    def max(self, x: float) -> float:
        if not self.on:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        self._call(lambda: td.all_reduce(t, op=td.ReduceOp.MAX))
        return float(t)

    def all_true(self, flag: bool) -> bool:
        return self.sum(0.0 if flag else 1.0) == 0.0 if self.on else bool(flag)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled: for metrics, not weights)."""
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call(lambda: td.all_gather_object(out, obj))
        return out

    def agree(self, error: str | None) -> None:
        """Raise the first rank's error on every rank: a check that fails on one rank (rank 0
        alone looks at the run directory) must not leave the others waiting in a collective."""
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise ParityError(errors[0])

    # -- the loss ----------------------------------------------------------------------------
    def sharer(self, totals: dict[str, float]
               ) -> "Callable[[torch.Tensor, float, str], torch.Tensor]":
        """`share(loss, n, unit)` for one optimizer step whose minibatch holds `totals[unit]`
        items of each unit (tokens, sequences, pairs) on this rank, in one or more pieces
        (micro-batches). `loss` is a mean over a piece's `n` items; gradients accumulate over
        pieces and DDP averages them over ranks, so scale it to n·world/N_total: the result is the
        gradient of the mean over all N_total items, as one forward in one process computes it."""
        units = list(totals)
        if self.on:
            t = torch.tensor([float(totals[u]) for u in units], dtype=torch.float64,
                             device=self.device)
            self._call(lambda: td.all_reduce(t))
            total = dict(zip(units, t.tolist()))
        else:
            total = {u: float(v) for u, v in totals.items()}

        def share(loss: torch.Tensor, n: float, unit: str) -> torch.Tensor:
            if not self.on and n == total[unit]:
                return loss  # the whole minibatch in one forward: nothing to rescale
            return loss * (n * self.world / total[unit]) if total[unit] > 0 else loss * 0.0
        return share

    @contextlib.contextmanager
    def accumulating(self, modules: list[Any], last: bool) -> Iterator[None]:
        """Around a micro-batch's backward: gradients are reduced over ranks only on the `last`
        one; before it, each rank accumulates its own (DDP's no_sync, FSDP2's gradient sync
        off), which is also what keeps ranks with unequal work from waiting on each other."""
        if last or not self.on:
            yield
            return
        with contextlib.ExitStack() as stack:
            for m in modules:
                if isinstance(m, torch.nn.parallel.DistributedDataParallel):
                    stack.enter_context(m.no_sync())
                elif hasattr(m, "set_requires_gradient_sync"):
                    m.set_requires_gradient_sync(False)
                    stack.callback(m.set_requires_gradient_sync, True)
            yield

    def wrap(self, module: torch.nn.Module | None) -> Any:
        if module is None or not self.on:
            return module
        # Buffers (rotary tables) never change: no broadcast before each forward.
        ids = [self.device] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids,
                                                         broadcast_buffers=False)

    def fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: each transformer block (the model's `_no_split_modules`) and then the rest is
        one unit whose parameters, gradients and optimizer state are split over the ranks."""
        # start-up: FSDP2 loads only when a run shards its model
        from torch.distributed.fsdp import fully_shard
        blocks = set(getattr(model, "_no_split_modules", None) or [])
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m)
        fully_shard(model)
        return model

    def close(self, finished: bool = False) -> None:
        """Leaves the process group. After a run that `finished`, every rank first waits for
        the others (rank 0 may still be writing the last checkpoint): a rank that tore its group
        down while a peer's connection was still open could abort at exit. After a failure
        nobody waits: a peer may never arrive."""
        if not (self.on and td.is_initialized()):
            return
        if finished:
            self._call(td.barrier)
        td.destroy_process_group()


def sharded(t: torch.Tensor) -> bool:
    """Whether `t` is an FSDP shard (a DTensor) rather than a whole tensor."""
    return hasattr(t, "full_tensor")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP) tensor gathered whole on every rank; any other tensor as it is. A
    collective: every rank must ask for the same tensors in the same order."""
    return t.full_tensor() if sharded(t) else t


def is_comm_failure(e: BaseException) -> bool:
    """A failed collective raised outside `Dist`'s own calls (DDP's and FSDP's gradient
    reductions inside backward)."""
    return isinstance(e, td.DistError) or any(
        w in str(e) for w in ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset"))


def failure_message(e: BaseException) -> str:
    rank = os.environ.get("RANK", "?")
    return (f"rank {rank}: a collective with the other ranks failed ({one_line(e)}): another "
            f"rank stopped or did not answer in time. The run stops here; `parity train --resume "
            f"RUN` continues it from its newest checkpoint")


def init(timeout_s: float, device: torch.device | None = None) -> Dist:
    """The launcher's rank and world size (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun and
    accelerate launch set them), computing on `device` (the CPU when None); one process
    without them."""
    device = device or torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(device=device)
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ParityError(f"WORLD_SIZE={world} but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: start "
                          f"multi-process runs with `torchrun --nproc_per_node N -m parity train "
                          f"...` or `accelerate launch`")
    if not td.is_initialized():
        try:
            td.init_process_group(backend(device), timeout=datetime.timedelta(seconds=timeout_s),
                                  **({"device_id": device} if device.type == "cuda" else {}))
        except (RuntimeError, ValueError) as e:
            raise ParityError(f"cannot join the process group: {one_line(e)}") from None
    return Dist(td.get_rank(), td.get_world_size(), device)
