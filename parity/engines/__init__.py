"""Rollout engines: one interface (`Engine`), a registry of the implementations (`ENGINES`), and
what they share.

- `hf` (parity/engines/hf.py): the transformers model in engine precision with a KV cache and
  parity's attention (parity/engines/attention.py), on CPU and GPU.
- `vllm` (parity/engines/vllm.py): vLLM in process, its CPU or CUDA build.
- parity/engines/async_process.py runs either one in a process of its own, a step ahead.
- parity/engines/scoring.py: the trainer's forward over a rollout, ℓ_π with gradient.

The trainer, the audit and the integrations hold an `Engine` and never ask which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from parity.engines.rollout import (
    EngineNeeds,
    Rollout,
    Sampling,
    Shard,
    keep_last,
    left_pad,
    logprobs_from_logits,
    positions,
    processed_logits,
    sample_rows,
    stop_token_ids,
    uniforms,
)

__all__ = ["ENGINES", "Engine", "EngineEntry", "EngineSpec", "Rollout", "Sampling", "Shard",
           "EngineNeeds", "check_engine", "keep_last", "left_pad", "logprobs_from_logits",
           "make_engine", "positions", "processed_logits", "sample_rows", "stop_token_ids",
           "uniforms"]


@runtime_checkable
class Engine(Protocol):
    """What the trainer, the audit and the integrations ask of a rollout engine. They hold an
    `Engine` and never ask which one it is: `hf` (parity/engines/hf.py) and `vllm`
    (parity/engines/vllm.py) are interchangeable behind it."""

    dtype: str                  # engine precision: bf16, fp16 or fp32
    model: torch.nn.Module      # the engine-precision copy of the weights it samples with
    version: int                # syncs so far (a checkpoint keeps it)
    pad_id: int

    @property
    def device(self) -> torch.device: ...

    def sync(self, master: torch.nn.Module) -> float:
        """Take the master's weights, cast to engine precision; returns sync/changed_frac."""

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take engine-precision weights pushed from another process."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None, max_batch: int = 0) -> Rollout:
        """One completion per prompt with ℓ_μ per token; `record_rows` also get the whole
        sampling distribution (Rollout.dists); at most `max_batch` prompts at a time."""

    def score(self, master: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
        """ℓ of `r`'s completion tokens computed by the engine itself on the master's current
        weights in engine precision ([B, T]); the engine's sampled weights stay as they were."""

    def replica(self) -> tuple[Callable[..., "Engine"], dict[str, Any]]:
        """(builder, kwargs): `builder(device=..., **kwargs)` makes the same engine in another
        process (the asynchronous engine)."""

    def close(self) -> None:
        """Free what the engine holds beyond Python objects (vLLM's engine core)."""


@dataclass(frozen=True)
class EngineSpec:
    """What any engine is built from."""
    master: torch.nn.Module
    model_dir: str
    dtype: str
    eos_ids: list[int]
    pad_id: int
    seed: int
    max_len: int            # the longest prompt plus max_new_tokens
    rows: int               # completions sampled at once (the KV cache vLLM reserves)
    cpu_fp16: str = "emulate"
    lm_head_fp32: bool = False
    gpu_memory: float = 0.3


def _hf(spec: EngineSpec) -> Engine:
    from parity.engines.hf import HFEngine
    return HFEngine(spec.master, spec.dtype, spec.eos_ids, spec.pad_id, spec.cpu_fp16,
                    spec.lm_head_fp32)


def _vllm(spec: EngineSpec) -> Engine:
    from parity.engines.vllm import VLLMEngine
    return VLLMEngine(spec.master, spec.model_dir, spec.dtype, spec.eos_ids, spec.pad_id,
                      spec.seed, spec.max_len, spec.rows, spec.gpu_memory, spec.lm_head_fp32)


def _vllm_check(config: Any, needs: EngineNeeds) -> None:
    from parity.engines.vllm import check
    check(config, needs)


@dataclass(frozen=True)
class EngineEntry:
    """One implementation of `Engine`. What it cannot do is said, before any engine is built,
    by `parity.config.ENGINE_CAN`."""
    # Can it run here (and on this model's config and needs, when given)? Asked before a run
    # directory exists, so that a run that cannot start leaves nothing behind.
    check: Callable[[Any, EngineNeeds], None]
    build: Callable[[EngineSpec], Engine]


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(check=lambda config, needs: None, build=_hf),
    "vllm": EngineEntry(check=_vllm_check, build=_vllm),
}


def make_engine(name: str, spec: EngineSpec) -> Engine:
    return ENGINES[name].build(spec)


def check_engine(name: str, config: Any = None, needs: EngineNeeds | None = None) -> None:
    """Refuse, in one line, an engine that cannot run here, or not on this model (`config`) or
    for what the run will ask of it (`needs`)."""
    ENGINES[name].check(config, needs or EngineNeeds())
