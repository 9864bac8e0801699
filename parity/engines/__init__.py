"""Rollout engines: one interface (`Engine`), a registry of the implementations (`ENGINES`), and
what they share.

- `hf` (parity/engines/hf.py): the transformers model in engine precision with a KV cache and
  parity's attention (parity/models/attention.py), on CPU and GPU.
- `vllm` (parity/engines/vllm.py): vLLM in process, its CPU or CUDA build.
- parity/engines/async_process.py runs either one in a process of its own, a step ahead.
- parity/models/forward.py: the trainer's forward over a rollout, ℓ_π with gradient.

The trainer, the audit and the integrations hold an `Engine` and never ask which one it is. An
engine is its module and one registry entry (`register`): its description, what it can do
(`EngineCan`), its checks and its builder. Config validation, `--help` and every refusal about
an engine's abilities read the entry (parity/engines/abilities.py). This module imports without
torch, so that the command line starts, and refuses bad settings, in a fraction of a second;
the shared pieces (`Rollout`, `Sampling`, ...) come from parity/logprobs and
parity/engines/rollout.py on first use.
"""

from __future__ import annotations

# Imports inside functions: this registry imports without torch (start-up time); an engine's
# module loads when the engine is built or checked.
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, runtime_checkable

from parity.engines.abilities import EngineCan, EngineNeeds, refuse_what_it_cannot
from parity.registry import Registry

if TYPE_CHECKING:
    import torch

    from parity.engines.rollout import Shard
    from parity.logprobs import Rollout, Sampling

__all__ = ["ENGINES", "Engine", "EngineCan", "EngineEntry", "EngineNeeds", "EngineSpec",
           "Rollout", "Sampling", "Shard", "check_engine", "make_engine", "register",
           "sample_rows", "stop_token_ids", "uniforms"]
# What the engines speak in, which imports torch, reachable from here: the batch and the
# sampling distribution (parity/logprobs), and what sampling needs beside them (rollout.py).
_SHARED = {"Rollout": "parity.logprobs", "Sampling": "parity.logprobs",
           "Shard": "parity.engines.rollout", "sample_rows": "parity.engines.rollout",
           "stop_token_ids": "parity.engines.rollout", "uniforms": "parity.engines.rollout"}


def __getattr__(name: str) -> Any:
    if name in _SHARED:
        import importlib
        return getattr(importlib.import_module(_SHARED[name]), name)
    raise AttributeError(f"module 'parity.engines' has no attribute {name!r}")


@runtime_checkable
class Engine(Protocol):
    """What the trainer, the audit and the integrations ask of a rollout engine. They hold an
    `Engine` and never ask which one it is: `hf` (parity/engines/hf.py) and `vllm`
    (parity/engines/vllm.py) are interchangeable behind it."""

    dtype: str                  # engine precision: bf16, fp16 or fp32
    version: int                # syncs so far (a checkpoint keeps it)
    pad_id: int

    @property
    def device(self) -> torch.device: ...

    def sync(self, master: torch.nn.Module) -> float:
        """Take the master's weights, cast to engine precision; returns sync/changed_frac."""

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take engine-precision weights pushed from another process."""

    def save_weights(self, directory: Path) -> None:
        """Its engine-precision weights, as last synced, into a checkpoint's directory."""

    def restore_weights(self, master: torch.nn.Module, directory: Path) -> None:
        """Its weights as `save_weights` left them (`master`: the run's restored weights)."""

    def weight_bytes(self) -> int:
        """What its engine-precision weights take on disk, at most."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None, max_batch: int = 0) -> Rollout:
        """One completion per prompt with ℓ_μ per token; `record_rows` also get the whole
        sampling distribution at their first `recorded_positions` positions (Rollout.dists);
        at most `max_batch` prompts at a time."""

    def score(self, master: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
        """ℓ of `r`'s completion tokens computed by the engine itself on the master's current
        weights in engine precision ([B, T]); the engine's sampled weights stay as they were."""

    def trace(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each token sequence through the engine's own forward on its sampled weights, every
        op's output as parity/models/trace.py names it (`parity audit --locate`)."""

    def trace_decode(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sequence's last token through the engine's decode step (the rest of the
        sequence in its KV cache): that step's points under the same names, one row each."""

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
    cuda_graphs: bool = False   # vLLM on a GPU: replay captured decode graphs


@dataclass(frozen=True)
class EngineEntry:
    """One implementation of `Engine`."""
    name: str
    summary: str            # one line, for --help
    can: EngineCan
    build: Callable[[EngineSpec], Engine]
    # What only this engine refuses, on this model's config (None: before it is loaded) and
    # for what the run needs: asked before a run directory exists, so that a run that cannot
    # start leaves nothing behind.
    check: Callable[[Any, EngineNeeds], None] = field(default=lambda config, needs: None)


ENGINES: Registry[EngineEntry] = Registry("engine")
register = ENGINES.register


def _hf(spec: EngineSpec) -> Engine:
    from parity.engines.hf import HFEngine
    return HFEngine(spec.master, spec.dtype, spec.eos_ids, spec.pad_id, spec.cpu_fp16,
                    spec.lm_head_fp32)


def _vllm(spec: EngineSpec) -> Engine:
    from parity.engines.vllm import VLLMEngine
    return VLLMEngine(spec.master, spec.model_dir, spec.dtype, spec.eos_ids, spec.pad_id,
                      spec.seed, spec.max_len, spec.rows, spec.gpu_memory, spec.cuda_graphs)


def _vllm_check(config: Any, needs: EngineNeeds) -> None:
    from parity.engines.vllm import check
    check(config, needs)


register(EngineEntry(
    name="hf", summary="parity's own: the transformers model in engine precision with a KV "
                       "cache",
    can=EngineCan(score_processed=True, lm_head_fp32=True, lora_unmerged=True, trace=True,
                  routing=True, invariant=True),
    build=_hf))
register(EngineEntry(
    name="vllm", summary="vLLM in the trainer's process, its CPU or CUDA build; install: "
                         "README.md, figures: docs/vllm.md",
    can=EngineCan(score_processed=False, lm_head_fp32=False, lora_unmerged=False,
                  min_p_after_top_p=False, min_temperature=0.01, trace=True, routing=True),
    build=_vllm, check=_vllm_check))
# A live server audited by `parity audit --server` is vLLM's (or SGLang's, whose greedy floor is
# lower): its temperature floor is the vllm engine's.
# vLLM served or driven by another framework (a server, TRL's own vLLM) has vLLM's abilities.
VLLM = ENGINES["vllm"].name
SERVER_MIN_TEMPERATURE = ENGINES[VLLM].can.min_temperature


def engines_that(test: Callable[[EngineCan], bool]) -> str:
    """The engines whose abilities pass `test`, for a refusal to offer."""
    return " or ".join(f"engine={n}" for n, e in ENGINES.items() if test(e.can)) or "another engine"


def refuse_unable(name: str, needs: EngineNeeds) -> None:
    """Refuse, in one line, what engine `name` cannot do of `needs` (its registry entry says)."""
    refuse_what_it_cannot(name, ENGINES[name].can, needs, engines_that)


def make_engine(name: str, spec: EngineSpec) -> Engine:
    from parity.models import lora  # torch: building an engine loads it anyway
    unmerged = lora.is_lora(spec.master) and not getattr(spec.master, "parity_merge", True)
    refuse_unable(name, EngineNeeds(lm_head_fp32=spec.lm_head_fp32, lora_unmerged=unmerged))
    return ENGINES[name].build(spec)


def check_engine(name: str, config: Any = None, needs: EngineNeeds | None = None) -> None:
    """Refuse, in one line, an engine that cannot run here, or not on this model (`config`) or
    for what the run will ask of it (`needs`)."""
    needs = needs or EngineNeeds()
    refuse_unable(name, needs)
    ENGINES[name].check(config, needs)
