"""What an engine can do (`EngineCan`, in its registry entry) and what a run asks of it
(`EngineNeeds`), and the one place a setting an engine cannot honour is refused. Imports
nothing heavy: the config checks its settings with it before torch is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parity.errors import ParityError


@dataclass(frozen=True)
class EngineCan:
    """What an engine can do, known before one is built."""
    # `Engine.score` gives processed log-probs (after temperature, top-p and top-k), as ℓ_μ
    # is. vLLM's prompt log-probs are the raw model's (docs/vllm.md).
    score_processed: bool
    lm_head_fp32: bool           # it can compute its LM head in fp32
    lora_unmerged: bool          # it can apply LoRA adapters unmerged (W x + B A x)
    # It applies min-p after top-p, as transformers and parity's scoring do (vLLM: before).
    min_p_after_top_p: bool = True
    # The lowest temperature it samples at as asked. vLLM raises any temperature in (0, 0.01)
    # to 0.01 and reports that distribution's log-probs, while the trainer scores the one asked
    # for: at 1e-6 its ℓ_μ is off by thousands (scripts/low_temperature.py, docs/vllm.md).
    min_temperature: float = 0.0
    # `Engine.trace`: its forward can be followed op by op (`parity audit --locate`).
    trace: bool = False
    # A mixture of experts' rollout carries the experts each token went through (`routed`).
    routing: bool = False
    # Its kernels are parity's batch-invariant ones (`kernels=invariant`).
    invariant: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineNeeds:
    """What a run asks of its engine. The settings are known before anything is loaded; the
    lengths once the model's config and the prompts are (before a run directory exists)."""
    lm_head_fp32: bool = False
    lora_unmerged: bool = False
    scores: bool = False          # `Engine.score` is called (shadow_kernels=scored)
    trace: bool = False           # `Engine.trace` is called (`parity audit --locate`)
    routing: bool = False         # the rollout's routing is replayed (`routing_replay`)
    invariant: bool = False       # the engine computes the trainer's bits (`kernels=invariant`)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_len: int = 0              # the longest prompt plus max_new_tokens

    @property
    def plain_sampling(self) -> bool:
        """Sampling that leaves the model's distribution as it is."""
        return (self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0
                and self.min_p <= 0.0 and self.repetition_penalty == 1.0)


def refuse_what_it_cannot(name: str, can: EngineCan, needs: EngineNeeds,
                          able: Callable[[Callable[[EngineCan], bool]], str]) -> None:
    """One line for the first need engine `name` cannot meet; `able(test)` names the engines
    whose abilities pass `test`, for the refusal to offer."""
    if needs.routing and not can.routing:
        raise ParityError(f"engine={name} returns no routing to replay: --routing-replay needs "
                          f"{able(lambda c: c.routing)}")
    if needs.invariant and not can.invariant:
        raise ParityError(f"engine={name} runs its own kernels, not parity's invariant ones: "
                          f"kernels=invariant needs {able(lambda c: c.invariant)}")
    if needs.lm_head_fp32 and not can.lm_head_fp32:
        raise ParityError(f"engine={name} runs its LM head in the engine's dtype: "
                          f"--lm-head-fp32 needs {able(lambda c: c.lm_head_fp32)}")
    if needs.lora_unmerged and not can.lora_unmerged:
        raise ParityError(f"engine={name} is given merged weights at each sync: an unmerged "
                          f"LoRA engine (--no-lora-merge) needs {able(lambda c: c.lora_unmerged)}")
    if needs.trace and not can.trace:
        raise ParityError(f"engine={name} cannot be traced op by op: --locate needs "
                          f"{able(lambda c: c.trace)}")
    if needs.temperature < can.min_temperature:
        refuse_temperature(needs.temperature, can.min_temperature, f"engine={name}",
                           f" or {able(lambda c: c.min_temperature <= needs.temperature)}")
    if needs.min_p > 0 and needs.top_p < 1 and not can.min_p_after_top_p:
        raise ParityError(f"engine={name} applies min_p before top_p, where transformers and "
                          f"parity's scoring apply it after: set min_p or top_p, not both, or "
                          f"use {able(lambda c: c.min_p_after_top_p)}")
    if needs.scores and not needs.plain_sampling and not can.score_processed:
        raise ParityError(f"shadow_kernels=scored with engine={name} scores with the raw "
                          f"model (its scoring ignores temperature, top-p, top-k, min-p and "
                          f"repetition penalties): sample at temperature 1 without them (here "
                          f"{needs.temperature}/{needs.top_p}/{needs.top_k}), or use "
                          f"shadow_kernels=engine")


def refuse_temperature(temperature: float, floor: float, who: str, other: str = "") -> None:
    """A temperature the engine (or a server) would raise silently: ℓ_μ would be the log-prob
    of another distribution than the one the trainer scores."""
    if temperature < floor:
        raise ParityError(f"temperature={temperature:g}: {who} samples every temperature below "
                          f"{floor:g} at {floor:g}, so its log-probs would not be those of the "
                          f"distribution parity scores; use temperature >= {floor:g}{other}")
