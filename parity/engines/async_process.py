"""Asynchronous rollouts: the engine in its own process, sampling while the trainer learns.

Versions count optimizer steps: the trainer's weights after step k are version k. The trainer
pushes its weights (cast to engine precision) after every `sync_every`-th step, and rollout j,
which step j trains on, is sampled from

    v(j) = the oldest pushed version ≥ j − 1 − max_staleness,

so its staleness j − 1 − v(j) never exceeds `max_staleness`, and the engine runs up to
`max_staleness` steps ahead of the trainer. The schedule depends on nothing but j, so a run is
reproducible and a resumed run continues exactly: the engine's random stream is the same one
the synchronous loop uses (one generator, rollouts in step order), and a checkpoint keeps the
pushed versions that later rollouts still need. With max_staleness = 0 every rollout waits for
the newest weights: the synchronous loop, in two processes.

The engine process gets its own torch threads (`engine_threads`); on a CPU the trainer keeps
the rest. Sampling and the trainer's forward passes hold the GIL for much of a decode step
(transformers' Python per layer), which is why this is a process and not a thread.
"""

from __future__ import annotations

import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from parity import cpu_bf16
from parity.engines import Engine, Shard
from parity.errors import ParityError
from parity.logprobs import Rollout, Sampling


@dataclass(kw_only=True)
class Request:
    """A rollout the engine process is asked for: step `step`'s prompts, on weights `version`."""
    step: int
    version: int
    prompts: list[list[int]]
    record_rows: list[int]
    shard: Shard
    max_batch: int = 0   # prompts decoded at once (Engine.generate)


@dataclass
class Sampled:
    """A rollout as the engine process sends it back, with what it was sampled from."""
    rollout: Rollout
    version: int          # the weights it was sampled from
    rollout_s: float      # the engine's time on it
    gen_state: torch.Tensor  # the sampling generator after it (a checkpoint resumes from there)


def _serve(build: Any, spec: dict[str, Any], s: Sampling, max_new_tokens: int, threads: int,
           gen_state: torch.Tensor, inbox: Any, outbox: Any, parent: int, device: str,
           products: tuple[bool, int]) -> None:
    """The engine process: load pushed weights, answer requests in order, until told to stop
    or the trainer is gone. Weights arrive and rollouts leave on the CPU (a CUDA tensor sent
    between processes lives only as long as its sender keeps it); it samples on `device`
    with the engine `build(device=..., **spec)` makes (Engine.replica), its products as the
    trainer's process runs them (`products`: the bf16 path and the row padding of
    kernels=invariant, parity/cpu_bf16.py), so it samples what a synchronous engine would."""
    try:
        torch.set_num_threads(threads)
        cpu_bf16.set_state(products)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        engine = build(device=dev, **spec)
        gen = torch.Generator()
        gen.set_state(gen_state)
        weights: dict[int, dict[str, torch.Tensor]] = {}
        loaded = None
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the trainer died without saying goodbye
                continue
            if msg[0] == "stop":
                engine.close()
                return
            if msg[0] == "weights":
                weights[msg[1]] = msg[2]
                continue
            req: Request = msg[1]
            if loaded != req.version:
                engine.load_state(weights[req.version])
                loaded = req.version
                for v in [v for v in weights if v < req.version]:
                    del weights[v]  # requests come in step order: older versions are done
            t0 = time.perf_counter()
            r = engine.generate(req.prompts, max_new_tokens, s, gen, req.record_rows, req.shard,
                                req.max_batch)
            outbox.put(("rollout", req.step, Sampled(r.to(torch.device("cpu")), req.version,
                                                     time.perf_counter() - t0, gen.get_state())))
    except Exception:
        outbox.put(("error", traceback.format_exc()))


class AsyncEngine:
    """The trainer's side: pushes weights, plans requests ahead, and hands out rollouts."""

    def __init__(self, mirror: Engine, s: Sampling, max_new_tokens: int, max_staleness: int,
                 sync_every: int, threads: int, gen: torch.Generator, version: int,
                 saved: dict[str, Any] | None = None,
                 saved_versions: dict[int, dict[str, torch.Tensor]] | None = None):
        """`mirror` holds the trainer's engine-precision weights of `version`, the first one
        pushed; a resumed run passes its checkpoint's `checkpoint_state()` and versions."""
        self.mirror, self.m, self.every = mirror, max_staleness, sync_every
        # The pushed versions later requests may still need, and each one's sync/changed_frac.
        if saved:
            self.pushed = dict(saved_versions or {})
            self.changed = {int(k): v for k, v in saved["changed"].items()}
        else:
            self.pushed, self.changed = {version: self._snapshot()}, {version: 0.0}
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        build, spec = mirror.replica()
        self.proc = ctx.Process(target=_serve, daemon=True, args=(
            build, spec, s, max_new_tokens, threads, gen.get_state(), self.inbox, self.outbox,
            os.getpid(), str(mirror.device), cpu_bf16.state()))
        self.proc.start()
        for v in sorted(self.pushed):
            self.inbox.put(("weights", v, self.pushed[v]))
        self.ready: dict[int, Sampled] = {}

    def version_for(self, step: int) -> int | None:
        """v(step), or None while no pushed version is new enough yet."""
        ok = [v for v in self.pushed if v >= step - 1 - self.m]
        return min(ok) if ok else None

    def push(self, version: int, master: torch.nn.Module) -> None:
        """After step `version`: cast and send the weights if this step is a sync step."""
        if version % self.every:
            return
        self.changed[version] = self.mirror.sync(master)
        state = self.pushed[version] = self._snapshot()
        self.inbox.put(("weights", version, state))
        for v in [v for v in self.pushed if v < version - self.m]:
            del self.pushed[v], self.changed[v]  # no later step can use it

    def _snapshot(self) -> dict[str, torch.Tensor]:
        # A copy of its own on the CPU: the mirror is cast into again while the engine still
        # reads this, and a checkpoint writes it. In shared memory before it is queued: else
        # the queue's feeder thread moves each tensor's storage there while a checkpoint of
        # the same step may be reading it, and the checkpoint can hold other weights.
        return {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in
                self.mirror.model.state_dict().items()}

    def submit(self, request: Request) -> None:
        self.inbox.put(("generate", request))

    def get(self, step: int) -> Sampled:
        """Rollout `step`, waiting for it; a dead or failed engine process is an error, not a
        hang."""
        while step not in self.ready:
            try:
                msg = self.outbox.get(timeout=1.0)
            except (queue.Empty, OSError, EOFError):
                # OSError: it died while handing over a rollout's shared memory
                self.proc.join(timeout=1.0)
                if not self.proc.is_alive():
                    raise ParityError(f"the engine process stopped (exit code "
                                      f"{self.proc.exitcode}) before it delivered the rollout of "
                                      f"step {step}") from None
                continue
            if msg[0] == "error":
                print(msg[1], file=sys.stderr)  # the engine's traceback, then one line
                last = msg[1].strip().splitlines()[-1]
                raise ParityError(f"the engine process failed at step {step}: {last}")
            self.ready[msg[1]] = msg[2]
        d = self.ready.pop(step)
        d.rollout = d.rollout.to(self.mirror.device)
        return d

    def checkpoint_state(self) -> dict[str, Any]:
        return {"pushed": sorted(self.pushed), "changed": {str(k): v for k, v in
                                                           self.changed.items()}}

    def close(self) -> None:
        """Stop the engine process: requests not yet started are dropped (on an error path
        there can be `max_staleness` of them), and rollouts it still sends are read away so
        that its queue can drain and the process exit."""
        _drain(self.inbox)
        if self.proc.is_alive():
            self.inbox.put(("stop",))
            deadline = time.monotonic() + 10
            while self.proc.is_alive() and time.monotonic() < deadline:
                _drain(self.outbox)
                self.proc.join(timeout=0.1)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)


def _drain(q: Any) -> None:
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass
