"""What a run needs in memory at its largest, said before it starts.

The estimate takes the worst case on the shape side (every completion as long as
max_new_tokens, the longest prompt in every row) and a calibrated constant on the model side:
the activations a forward with gradient keeps per token and layer. It is a guide, not a bound:
bench/memory.py prints it beside the measured peak (docs/performance.md), and it is 23% over
SmolLM2-135M's unbatched 64 x 64 step but 39% under a 16 x 1024 step with checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity.errors import ParityError

# Bytes a forward with gradient keeps per token per layer, in units of the width in fp32: the
# residual stream, norms, projections, MLP and attention outputs. 32 fits SmolLM2-135M's
# measured 2.1 MB a token (30 layers, width 576) for short completions.
_ACT_PER_LAYER = 32
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The process before any model: Python, torch, transformers and their allocators (measured
# 0.4-0.5 GB on the testbed's smallest runs).
_RUNTIME = 0.5 * 2 ** 30


@dataclass
class Estimate:
    weights: float       # bytes: master weights, gradients, optimizer state, engine/shadow copies
    forward: float       # bytes: the largest forward with gradient (activations and logits)
    rows: int            # completions in that forward

    @property
    def total(self) -> float:
        return self.weights + self.forward


def available(device: Any = None) -> float | None:
    """Bytes free on the run's device: the GPU's free memory on CUDA, MemAvailable from
    /proc/meminfo on the CPU (Linux); None where the system does not say."""
    if device is not None and device.type == "cuda":
        import torch
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate(cfg: Any, model: Any, longest_prompt: int, world: int = 1,
             micro_batch: int | None = None) -> Estimate:
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)  # LoRA: adapters
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 1)
    width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 1)
    vocab = c.vocab_size
    engine = _BYTES[cfg.engine_dtype] * n_params
    adam = 8 if cfg.optimizer in ("adam", "adamw") else 0  # two fp32 moments
    weights = _RUNTIME + stored + n_train * (4 + adam) + engine  # + gradients, optimizer state
    if cfg.diagnostics or cfg.ratio_source == "shadow":
        weights += engine  # the shadow's own copy
    rows = cfg.prompts_per_step * cfg.samples_per_prompt // cfg.minibatches // world
    mb = cfg.micro_batch if micro_batch is None else micro_batch
    rows = min(rows, mb) if mb else rows
    length = longest_prompt + cfg.max_new_tokens
    if cfg.micro_batch_tokens:
        rows = max(1, min(rows, cfg.micro_batch_tokens // length))
    act = layers * width * _ACT_PER_LAYER * _BYTES[cfg.trainer_dtype]
    if cfg.gradient_checkpointing:  # each layer's input, and one layer recomputed at a time
        act = layers * width * 4 + width * _ACT_PER_LAYER * 4
    positions = min(cfg.logprob_chunk, cfg.max_new_tokens) if cfg.logprob_chunk else cfg.max_new_tokens
    logits = 3 * rows * positions * vocab * 4  # logits, log-softmax, its gradient (fp32)
    # Held through the update: the engine's whole distribution at every position of the rows
    # kept for the exact KL, fp32.
    dists = cfg.kl_exact_rows * cfg.max_new_tokens * vocab * 4 if cfg.diagnostics else 0
    # The exact KL's float64 terms, about ten of them over 64 positions at a time
    # (diagnostics.KL_CHUNK), beside the update's own peak.
    if cfg.diagnostics and cfg.kl_exact_rows:
        logits += 10 * min(64, cfg.max_new_tokens) * vocab * 8
    # Before it, while sampling: the engine's KV cache over the rows it decodes at once.
    sampled = cfg.prompts_per_step * cfg.samples_per_prompt // world
    decoding = min(sampled, cfg.rollout_batch) if cfg.rollout_batch else sampled
    kv_width = getattr(c, "num_key_value_heads", None) or getattr(c, "n_head", 1)
    head = width // (getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1))
    kv = 2 * layers * decoding * kv_width * head * length * _BYTES[cfg.engine_dtype]
    return Estimate(weights + dists, max(rows * length * act + logits, kv), rows)


def check(cfg: Any, model: Any, longest_prompt: int, world: int = 1,
          device: Any = None) -> str | None:
    """None when the run fits the memory available now on `device` (the CPU when None); else a
    warning naming the setting to change. A run whose weights and optimizer alone exceed it is
    refused."""
    free = available(device)
    where = " on the GPU" if device is not None and device.type == "cuda" else ""
    if free is None:
        return None
    e = estimate(cfg, model, longest_prompt, world)
    gb = 2 ** 30
    if e.weights > free:
        raise ParityError(f"this run's weights, gradients and optimizer state need "
                          f"{e.weights / gb:.1f} GB and {free / gb:.1f} GB is available{where}: a "
                          f"smaller model, or more ranks under FSDP")
    if e.total <= free:
        return None
    fits = [n for n in (64, 32, 16, 8, 4, 2, 1) if n < e.rows and
            estimate(cfg, model, longest_prompt, world, micro_batch=n).total <= 0.9 * free]
    advice = (f"--micro-batch {fits[0]}" if fits else
              "--micro-batch 1 with --logprob-chunk 64 --gradient-checkpointing, or shorter "
              "--max-new-tokens")
    return (f"this run may need about {e.total / gb:.1f} GB (its largest forward holds {e.rows} "
            f"completions of up to {longest_prompt + cfg.max_new_tokens} tokens) and "
            f"{free / gb:.1f} GB is available{where}; if it is killed, use {advice}")
