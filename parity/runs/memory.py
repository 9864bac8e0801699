"""What a run needs in memory at its largest, said before it starts.

The estimate takes the worst case on the shape side (every completion as long as
max_new_tokens, the longest prompt in every row) and a calibrated constant on the model side:
the activations a forward with gradient keeps per token and layer. It is a guide, not a bound:
bench/memory.py prints it beside the measured peak (docs/performance.md), and it is 23% over
SmolLM2-135M's unbatched 64 x 64 step but 39% under a 16 x 1024 step with checkpointing.
"""

from __future__ import annotations

# Imports inside functions: torch loads when a device's memory is asked for: the estimate itself
# runs before any model is loaded (start-up time).
import dataclasses
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parity.errors import ParityError
from parity.models import lora
from parity.models.sizes import DTYPE_BYTES
from parity.objectives import OBJECTIVES

if TYPE_CHECKING:
    from parity.config import Config

# Bytes a forward with gradient keeps per token per layer, in units of the width in fp32: the
# residual stream, norms, projections, MLP and attention outputs. 32 fits SmolLM2-135M's
# measured 2.1 MB a token (30 layers, width 576) for short completions.
_ACT_PER_LAYER = 32
# The process before any model: Python, torch, transformers and their allocators (measured
# 0.4-0.5 GB on the testbed's smallest runs).
_RUNTIME = 0.5 * 2 ** 30


@dataclass(kw_only=True)
class Estimate:
    weights: float       # bytes: master weights, gradients, optimizer state, engine/shadow copies
    forward: float       # bytes: the largest forward with gradient (activations and logits)
    rows: int            # completions in that forward
    sampling: bool = False  # the largest forward is the engine's KV cache, not the update's
    adapters: int = 0    # LoRA adapter parameters among the weights

    @property
    def total(self) -> float:
        return self.weights + self.forward


def _read_number(path: str, key: str | None = None) -> float | None:
    """A number from a /proc or /sys file: the file's whole content, or the line starting with
    `key` (its value in kB); None where the file is absent or says "max"."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    if key is None:
        text = text.strip()
        return float(text) if text.isdigit() else None
    for line in text.splitlines():
        if line.startswith(key):
            return float(line.split()[1]) * 1024
    return None


def limits() -> dict[str, float]:
    """Every limit on this process's memory the system states, in bytes free under each: the
    machine's MemAvailable, its cgroup's limit less its usage (v2, or v1), and the address space
    `ulimit -v` leaves beside what the process maps already."""
    out = {}
    if (free := _read_number("/proc/meminfo", "MemAvailable:")) is not None:
        out["available memory"] = free
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_number(limit), _read_number(usage)
        if cap is not None and used is not None and cap < 2 ** 60:  # v1 writes "no limit" huge
            out["the cgroup's memory limit"] = max(0.0, cap - used)
            break
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        mapped = _read_number("/proc/self/status", "VmSize:") or 0.0
        out["the address space ulimit -v allows"] = max(0.0, soft - mapped)
    return out


def available(device: Any = None) -> float | None:
    """Bytes free to the run on its device: the GPU's free memory on CUDA; on the CPU the
    tightest of `limits()` (Linux); None where the system does not say."""
    if device is not None and device.type == "cuda":
        import torch
        return float(torch.cuda.mem_get_info(device)[0])
    return min(limits().values(), default=None)


def _which(device: Any, free: float) -> str:
    """The limit `free` came from, for the message."""
    if device is not None and device.type == "cuda":
        return "free on the GPU"
    found = limits()
    name = min(found, key=lambda k: abs(found[k] - free), default=None)
    if name is None or abs(found[name] - free) > 0.05 * free + 2 ** 20:
        return "free"  # a figure given by the caller
    return f"free under {name}"


def estimate(cfg: Config, model: Any, longest_prompt: int, world: int = 1,
             micro_batch: int | None = None, device: Any = None) -> Estimate:
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)  # LoRA: adapters
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = 0
    if getattr(cfg, "lora_rank", 0) and not lora.is_lora(model):  # the adapters to come
        adapters = lora.planned_adapters(model, cfg.lora_rank, cfg.lora_targets)
        stored = n_params * DTYPE_BYTES[cfg.base_dtype] + 4 * adapters
        n_params, n_train = n_params + adapters, adapters
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 1)
    width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 1)
    vocab = c.vocab_size
    engine = DTYPE_BYTES[cfg.engine_dtype] * n_params
    adam = 8 if cfg.optimizer in ("adam", "adamw") else 0  # two fp32 moments
    weights = _RUNTIME + stored + n_train * (4 + adam) + engine  # + gradients, optimizer state
    if cfg.diagnostics or cfg.ratio_source == "shadow":
        weights += engine  # the shadow's own copy
    if OBJECTIVES[cfg.objective].reference and cfg.dpo_ref == "initial":
        weights += stored  # the frozen initial policy
    if getattr(cfg, "async_engine", False):  # the pushed versions a stale rollout may still need
        weights += (cfg.max_staleness + 1) * engine
    rows = cfg.prompts_per_step * cfg.samples_per_prompt // cfg.minibatches // world
    mb = cfg.micro_batch if micro_batch is None else micro_batch
    rows = min(rows, mb) if mb else rows
    length = longest_prompt + cfg.max_new_tokens
    if cfg.micro_batch_tokens:
        rows = max(1, min(rows, cfg.micro_batch_tokens // length))
    act = layers * width * _ACT_PER_LAYER * DTYPE_BYTES[cfg.trainer_dtype]
    if cfg.gradient_checkpointing:  # each layer's input, and one layer recomputed at a time
        act = layers * width * 4 + width * _ACT_PER_LAYER * 4
    # fp32 logits, their processed copy and their gradient, for the tokens scored at once, and
    # the logits the default chunks keep for the backward
    tokens = rows * cfg.max_new_tokens
    logits = (3 * _scored_at_once(cfg, tokens, vocab, device) + _kept(cfg, tokens, vocab)) \
        * vocab * 4
    # Held through the update: the engine's whole distribution at every position of the rows
    # kept for the exact KL, fp32.
    dists = (cfg.kl_exact_rows * _recorded(cfg.max_new_tokens, vocab) * vocab * 4
             if cfg.diagnostics else 0)
    # Before it, while sampling: the engine's KV cache over the rows it decodes at once.
    sampled = cfg.prompts_per_step * cfg.samples_per_prompt // world
    decoding = min(sampled, cfg.rollout_batch) if cfg.rollout_batch else sampled
    kv_width = getattr(c, "num_key_value_heads", None) or getattr(c, "n_head", 1)
    head = width // (getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1))
    kv = 2 * layers * decoding * kv_width * head * length * DTYPE_BYTES[cfg.engine_dtype]
    return Estimate(weights=weights + dists, forward=max(rows * length * act + logits, kv),
                    rows=rows, sampling=kv >= rows * length * act + logits, adapters=adapters)


# A run estimated at more than this many times the memory free is refused rather than warned
# about: the estimate errs by at most ~40% either way (docs/performance.md).
REFUSE_FACTOR = 2.0


def _recorded(length: int, vocab: int) -> int:
    """Positions of a row whose whole distribution the exact KL keeps."""
    # torch is loaded by now: the model is
    from parity.logprobs import recorded_positions
    return min(length, recorded_positions(vocab))


def _scored_at_once(cfg: Config, tokens: int, vocab: int, device: Any) -> int:
    """Completion tokens whose vocabulary-wide logits exist at once in a forward of `tokens`."""
    # torch is loaded by now: the model is
    from parity.logprobs import head_chunk
    if cfg.logprob_chunk == -1:
        return tokens
    return min(tokens, cfg.logprob_chunk or head_chunk(vocab, device))


def _kept(cfg: Config, tokens: int, vocab: int) -> int:
    """Completion tokens whose logits the default chunks keep for the backward."""
    from parity.logprobs import kept_tokens
    return min(tokens, kept_tokens(vocab)) if cfg.logprob_chunk == 0 else 0


def check(cfg: Config, model: Any, longest_prompt: int, world: int = 1,
          device: Any = None) -> str | None:
    """None when the run fits the memory free to it now on `device` (the CPU when None: the
    tightest of the machine's, the cgroup's and `ulimit -v`'s limits); else a warning naming the
    setting to change. A run whose weights and optimizer alone exceed it, or whose estimate is
    far beyond it, is refused before anything is written, naming the setting to lower."""
    free = available(device)
    if free is None:
        return None
    where = _which(device, free)
    e = estimate(cfg, model, longest_prompt, world, device=device)
    gb = 2 ** 30
    if e.weights > free:
        lower = (f"lower --lora-rank (rank {cfg.lora_rank} adds {e.adapters:,} adapter "
                 f"parameters)" if e.adapters * 16 > e.weights / 2 else
                 "a smaller model, or more ranks under FSDP")
        raise ParityError(f"this run's weights, gradients and optimizer state need "
                          f"{e.weights / gb:.1f} GB and {free / gb:.1f} GB is available ({where}): "
                          f"{lower}")
    if e.total <= free:
        return None
    advice = _advice(cfg, model, longest_prompt, world, e, free, device)
    need = (f"this run may need about {e.total / gb:.1f} GB (its largest "
            + (f"batch of sampling decodes {_decoding(cfg, world)} rows"
               if e.sampling else f"forward holds {e.rows} completions")
            + f" of up to {longest_prompt + cfg.max_new_tokens} tokens) and {free / gb:.1f} GB "
              f"is available ({where})")
    if e.total > REFUSE_FACTOR * free:
        raise ParityError(f"{need}: use {advice}")
    return f"{need}; if it is killed, use {advice}"


def _decoding(cfg: Config, world: int) -> int:
    sampled = cfg.prompts_per_step * cfg.samples_per_prompt // world
    return min(sampled, cfg.rollout_batch) if cfg.rollout_batch else sampled


def _advice(cfg: Config, model: Any, longest_prompt: int, world: int, e: Estimate,
            free: float, device: Any = None) -> str:
    """The setting to lower, and the value that fits where one does."""
    fits = lambda total: total <= 0.9 * free
    if e.sampling:
        ok = [n for n in (64, 32, 16, 8, 4, 2, 1) if n < _decoding(cfg, world) and
              fits(estimate(dataclasses.replace(cfg, rollout_batch=n), model, longest_prompt,
                            world).total)]
        if ok:
            return f"--rollout-batch {ok[0]}"
        return "fewer --prompts-per-step or --samples-per-prompt, or shorter --max-new-tokens"
    chunked = dataclasses.replace(cfg, logprob_chunk=0)
    if cfg.logprob_chunk == -1 and fits(estimate(chunked, model, longest_prompt, world,
                                                 device=device).total):
        return "--logprob-chunk 0 (the log-probs a chunk of tokens at a time)"
    ok = [n for n in (64, 32, 16, 8, 4, 2, 1) if n < e.rows and
          fits(estimate(cfg, model, longest_prompt, world, micro_batch=n, device=device).total)]
    if ok:
        return f"--micro-batch {ok[0]}"
    return "--micro-batch 1 with --gradient-checkpointing, or shorter --max-new-tokens"


def out_of_memory(e: BaseException) -> bool:
    """Whether an exception is an allocation that failed: CUDA's OutOfMemoryError, Python's
    MemoryError, or the CPU allocator's RuntimeError."""
    import torch
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e)
                                            or "out of memory" in str(e).lower())


def oom_message(cfg: Config, e: BaseException) -> str:
    """One line for an allocation that failed mid-run: the settings that scale memory, as this
    run set them, the first to lower named first."""
    lower = []
    if cfg.lora_rank:
        lower.append(f"--lora-rank {cfg.lora_rank}")
    lower.append(f"--micro-batch (now {cfg.micro_batch or 'the whole minibatch'})")
    lower.append(f"--rollout-batch (now {cfg.rollout_batch or 'every prompt at once'})")
    lower.append(f"--prompts-per-step {cfg.prompts_per_step} x --samples-per-prompt "
                 f"{cfg.samples_per_prompt}")
    lower.append(f"--max-new-tokens {cfg.max_new_tokens}")
    kind = "the GPU" if type(e).__name__ == "OutOfMemoryError" else "memory"
    return (f"the run ran out of {kind} ({type(e).__name__}); lower one of: {', '.join(lower)}, "
            f"or add --gradient-checkpointing. The steps written so far are in "
            f"metrics.jsonl and `parity train --resume RUN` continues from the newest checkpoint")
