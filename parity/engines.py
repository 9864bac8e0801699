"""Rollout engines, and the sampling distribution they and the trainer share.

The `hf` engine samples from the transformers model in engine precision with a KV cache and
records, for every sampled token, ℓ_μ: its log-prob under the distribution actually sampled from
(temperature, top-k and top-p applied, renormalised). The trainer scores tokens with the same
`logprobs_from_logits`, so with equal weights and equal precision ℓ_π = ℓ_μ up to kernel noise.
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from transformers import AttentionInterface, StaticCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from parity.precision import cast_weights_into, fp16_kernels, low_precision_copy


def engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     parity_kv_len: int | None = None, parity_scratch: dict | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention's arithmetic (QKᵀ and the product with V in the model's dtype, the
    softmax in fp32, as transformers' eager path for Llama-family models), without what made
    decoding slow down with length: the static cache is read only up to `parity_kv_len`, the
    positions filled so far, instead of all of it at every token; and grouped-query heads share
    their key/value head through a reshape of the query instead of eager's `repeat_kv`, which
    copied every cached key and value once per query head per layer per token (figures:
    docs/performance.md). Without `parity_kv_len` (the shadow's full forward) it attends to
    every key it is given. `parity_scratch` (a dict the decode loop owns) holds one buffer that
    every layer's key copy reuses."""
    if parity_kv_len is not None:
        # The filled part of the static cache is a view strided over its whole length, on
        # which CPU's batched QKᵀ takes a slow path; a contiguous copy of the keys costs less
        # and gives the same products, bit for bit: decoding runs 1.5-1.9× faster at 256-1,024
        # tokens. The copy goes into one reused buffer: a fresh tensor of that size each layer
        # and token is a fresh allocation the OS must zero, which made the copy 5× slower than
        # the products at 4,096 tokens (docs/performance.md).
        filled = key[:, :, :parity_kv_len]
        buf = None if parity_scratch is None else parity_scratch.get("keys")
        if parity_scratch is not None and (buf is None or buf.dtype != key.dtype
                                           or buf.numel() < filled.numel()):
            buf = parity_scratch["keys"] = torch.empty(key.numel(), dtype=key.dtype,
                                                       device=key.device)
        key = (filled.contiguous() if buf is None
               else buf[:filled.numel()].view(filled.shape).copy_(filled))
        value = value[:, :, :parity_kv_len]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :parity_kv_len]
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        # Capped logits or attention sinks (Gemma 2, gpt-oss): the model's own eager path.
        own = sys.modules[type(module).__module__].eager_attention_forward
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                   **kwargs)
    B, H, q, d = query.shape
    kv, L = key.shape[1], key.shape[2]
    g = H // kv    # query heads per key/value head, in repeat_kv's order (head = j·g + i)
    w = torch.matmul(query.reshape(B, kv, g * q, d), key.transpose(2, 3))
    w = w * (d ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        w = (w.view(B, kv, g, q, L) + attention_mask[:, :, None]).view(B, kv, g * q, L)
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and module.training:
        w = torch.nn.functional.dropout(w, p=dropout)
    out = torch.matmul(w, value).view(B, H, q, d)
    return out.transpose(1, 2).contiguous(), None


# A decode step attends one query to a short cache, where torch's CPU SDPA kernel costs more
# in setup than the products do; `engine_attention` is eager's arithmetic without its costs at
# length. The shadow forward attends the same way, because a different attention kernel would
# put a kernel gap inside α. Figures: docs/performance.md.
ENGINE_ATTENTION = "parity_eager"
AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
AttentionMaskInterface.register(ENGINE_ATTENTION, eager_mask)  # the additive mask eager uses


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


def processed_logits(logits: torch.Tensor, s: Sampling,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits of the sampling distribution: temperature, then top-k, then top-p (the order
    transformers and vLLM use); removed tokens get -inf. `keep` (token ids, shape logits[..., 0])
    is never removed: the trainer must not score a token the engine really sampled as impossible
    just because its own logits put it a hair outside the nucleus."""
    x = logits.float() / s.temperature
    if not s.truncates:
        return x
    remove = torch.zeros_like(x, dtype=torch.bool)
    if s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        remove |= x < kth
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x.masked_fill(remove, float("-inf")), dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        remove |= torch.zeros_like(remove).scatter(-1, order, mass_before >= s.top_p)
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return x.masked_fill(remove, float("-inf"))


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling,
                         keep_sampled: bool = True) -> torch.Tensor:
    """log p(token) under the sampling distribution defined by `s`; fp32, shape of `tokens`."""
    x = processed_logits(logits, s, keep=tokens if keep_sampled else None)
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


@dataclass
class Rollout:
    """A batch of completions. Prompts are left-padded, completions right-padded; EOS, when
    sampled, is the last valid completion token."""
    prompt_ids: torch.Tensor        # [B, P] long
    prompt_mask: torch.Tensor       # [B, P] long, 0 on left padding
    completion_ids: torch.Tensor    # [B, T] long, pad after the end
    completion_mask: torch.Tensor   # [B, T] float, 1 on valid completion tokens
    engine_logprobs: torch.Tensor   # [B, T] fp32 ℓ_μ, 0 on padding
    finished: torch.Tensor          # [B] bool, True where the completion ended with EOS
    # The engine's whole sampling distribution at every position of a few rows, for the exact
    # KL(μ‖π): `dist_rows` [k] indexes the batch, `dists` [k, T, V] fp32 log-probs.
    dist_rows: torch.Tensor | None = None
    dists: torch.Tensor | None = None

    _BATCHED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                "engine_logprobs", "finished")

    def select(self, idx: torch.Tensor | slice) -> "Rollout":
        """The completions `idx` picks (the recorded distributions stay with the full batch)."""
        return Rollout(*(getattr(self, f)[idx] for f in self._BATCHED))

    def pad_to(self, T: int, pad_id: int) -> "Rollout":
        """The same completions right-padded to T positions (the batch's length on every rank,
        so the trainer's products have one process's shapes)."""
        n = T - self.completion_ids.shape[1]
        if n <= 0:
            return self
        pad = torch.nn.functional.pad
        return Rollout(self.prompt_ids, self.prompt_mask,
                       pad(self.completion_ids, (0, n), value=pad_id),
                       pad(self.completion_mask, (0, n)), pad(self.engine_logprobs, (0, n)),
                       self.finished, self.dist_rows, self.dists)

    def to(self, device: torch.device) -> "Rollout":
        """The rollout on `device` (one from another process, or from vLLM, arrives on the CPU)."""
        move = lambda x: x.to(device) if x is not None else None  # noqa: E731
        return Rollout(*(move(getattr(self, f)) for f in self._BATCHED), move(self.dist_rows),
                       move(self.dists))

    def completions(self) -> list[list[int]]:
        lens = self.completion_mask.sum(-1).long().tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lens)]


def left_pad(prompts: list[list[int]], pad_id: int, width: int = 0,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, [len(prompts), width], on `device`: built row by row on
    the host, then copied once."""
    width = max(width, max(len(p) for p in prompts))
    cpu = torch.device("cpu")
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=cpu)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=cpu)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device=cpu)
        mask[i, width - len(p):] = 1
    return (ids.to(device), mask.to(device)) if device is not None else (ids, mask)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding, so a padded prompt sees the positions it would see
    alone; the engine and the trainer must agree on them token for token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def keep_last(length: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """`logits_to_keep` as an index tensor rather than an int. transformers slices the hidden
    states with an int, and for a head weight that does not require grad (the engine's and the
    shadow's copies) a strided [B, n, d] slice sends the LM head down torch's batched path, which
    copies the head's weight once per row. Indexing with a tensor gives a contiguous copy
    instead, and the head runs as one product (figures: docs/performance.md)."""
    return torch.arange(length - n, length, device=device)


def uniforms(generator: torch.Generator, batch: int, rows: torch.Tensor | None = None,
             device: torch.device | None = None) -> torch.Tensor:
    """One float64 uniform per row of a `batch` for one sampled position, [len(rows), 1], on
    `device`. A rank that samples only `rows` of the batch still draws all `batch` numbers, so
    its rows get the numbers a one-process run gives them and the generators of all ranks stay
    equal. The generator is a CPU one on every device (parity/devices.py): a seed samples from
    the same numbers on a GPU as on the CPU."""
    u = torch.rand((batch, 1), generator=generator, dtype=torch.float64, device=generator.device)
    u = u if rows is None else u[rows]
    # A small copy without waiting for the device's queue (the host buffer is staged at once).
    return u.to(device) if device is not None else u


def sample_rows(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logp` [B, V], drawn from exp(logp) by inverse CDF with the uniforms
    `u` [B, 1]. torch.multinomial draws an exponential per vocabulary entry instead, B·V random
    numbers a token, a large share of a decode step (docs/performance.md). The CDF
    is summed in float64 so a token's share of [0, 1) is its probability to ~1e-16."""
    c = logp.double().exp().cumsum(-1)
    return torch.searchsorted(c, u * c[:, -1:], right=True).squeeze(-1).clamp(
        max=logp.shape[-1] - 1)


@dataclass(frozen=True)
class Shard:
    """The rows of a batch that this rank samples (`rows`, positions in the whole `batch`), and
    how to learn that every rank's rows have ended (decoding stops together, as one process
    stops when all of its rows have)."""
    rows: list[int]
    batch: int
    all_done: Callable[[bool], bool] = bool
    # The whole batch's prompt width: every rank pads its prompts as one process would, so the
    # engine's low-precision products have the same shapes (bf16 results depend on them).
    width: int = 0
    # Draw every position's numbers even after all rows have ended, so that ranks which stop
    # at different lengths (asynchronous engines, one per rank) keep equal generators.
    fixed_draws: bool = False


def stop_token_ids(model: torch.nn.Module, tok: Any) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's
    (a chat model's end-of-turn token, e.g. Qwen's <|im_end|>)."""
    ids = [tok.eos_token_id]
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in ([gen] if isinstance(gen, int) else list(gen or [])):
        if i not in ids:
            ids.append(i)
    return ids


@runtime_checkable
class Engine(Protocol):
    """What the trainer, the audit and the integrations ask of a rollout engine. They hold an
    `Engine` and never ask which one it is: `hf` (HFEngine, below) and `vllm`
    (parity/vllm_engine.py) are interchangeable behind it."""

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


def _hf(spec: EngineSpec) -> "HFEngine":
    return HFEngine(spec.master, spec.dtype, spec.eos_ids, spec.pad_id, spec.cpu_fp16,
                    spec.lm_head_fp32)


def _vllm(spec: EngineSpec) -> Engine:
    from parity.vllm_engine import VLLMEngine
    return VLLMEngine(spec.master, spec.model_dir, spec.dtype, spec.eos_ids, spec.pad_id,
                      spec.seed, spec.max_len, spec.rows, spec.gpu_memory, spec.lm_head_fp32)


def _vllm_check(config: Any) -> None:
    from parity.vllm_engine import check_available, check_architecture
    check_available()
    if config is not None:
        check_architecture(config)


# name → (check that it can run here, and on this model's config when given, before a run
# directory exists; build)
ENGINES: dict[str, tuple[Callable[[Any], None], Callable[[EngineSpec], Engine]]] = {
    "hf": (lambda config: None, _hf),
    "vllm": (_vllm_check, _vllm),
}


def make_engine(name: str, spec: EngineSpec) -> Engine:
    return ENGINES[name][1](spec)


def check_engine(name: str, config: Any = None) -> None:
    ENGINES[name][0](config)


class HFEngine:
    """Batched sampling with a KV cache on the engine's own engine-precision copy of the model."""

    def __init__(self, master: torch.nn.Module, dtype: str, eos_id: int | list[int], pad_id: int,
                 cpu_fp16: str = "emulate", lm_head_fp32: bool = False):
        self.dtype, self.cpu_fp16 = dtype, cpu_fp16
        self.model = low_precision_copy(master, dtype, lm_head_fp32)
        self._setup(eos_id, pad_id)

    @classmethod
    def of_copy(cls, model: torch.nn.Module, dtype: str, eos_id: int | list[int], pad_id: int,
                cpu_fp16: str = "emulate") -> "HFEngine":
        """An engine on a model that already is an engine-precision copy (the async engine
        process receives one)."""
        self = cls.__new__(cls)
        self.dtype, self.cpu_fp16, self.model = dtype, cpu_fp16, model
        self._setup(eos_id, pad_id)
        return self

    def _setup(self, eos_id: int | list[int], pad_id: int) -> None:
        self.model.set_attn_implementation(ENGINE_ATTENTION)
        # transformers renamed the forward's `past_key_values` to `cache` (5.24), and warns at
        # every decode step when given the old name.
        inner = getattr(self.model, "get_base_model", lambda: self.model)()  # an unmerged LoRA copy
        params = inspect.signature(inner.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        # Chat models end a turn with their own token (<|im_end|>) besides the tokenizer's EOS.
        self.eos_ids = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id),
                                    device=self.device)
        self.pad_id = pad_id
        self.version = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync(self, master: torch.nn.Module) -> float:
        """Cast the fp32 master weights into the engine; returns `sync/changed_frac`."""
        self.version += 1
        return cast_weights_into(master, self.model)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    @torch.no_grad()
    def score(self, master: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
        """The engine's own forward on a scratch copy (its sampled weights stay for the next
        sync's changed_frac): the same attention and precision as its decode steps."""
        if getattr(self, "_scratch", None) is None:
            self._scratch = copy.deepcopy(self.model)
        cast_weights_into(master, self._scratch, count=False)
        ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
        mask = torch.cat([r.prompt_mask, r.completion_mask.long()], dim=1)
        T = r.completion_ids.shape[1]
        with fp16_kernels(self.dtype, self.device, self.cpu_fp16):
            # the logits that predict each completion token: positions P-1 .. P+T-2
            logits = self._scratch(input_ids=ids, attention_mask=mask,
                                   position_ids=positions(mask),
                                   logits_to_keep=keep_last(ids.shape[1], T + 1, ids.device)
                                   ).logits[:, :-1]
        return logprobs_from_logits(logits, r.completion_ids, s) * r.completion_mask

    def replica(self) -> tuple[Callable[..., "Engine"], dict[str, Any]]:
        return _hf_replica, dict(model=copy.deepcopy(self.model).cpu(), dtype=self.dtype,
                                 eos_id=self.eos_ids.tolist(), pad_id=self.pad_id,
                                 cpu_fp16=self.cpu_fp16)

    def close(self) -> None:
        self._scratch = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None, max_batch: int = 0) -> Rollout:
        """Sample one completion per prompt. For the batch rows in `record_rows` the whole
        sampling distribution at every position is kept as well (`Rollout.dists`). With a
        `shard` the prompts are some rows of a batch sampled across ranks. `max_batch` > 0
        decodes at most that many prompts at a time (the KV cache and the logits scale with
        it), with the same results."""
        shard = shard or Shard(list(range(len(prompts))), len(prompts))
        with fp16_kernels(self.dtype, self.device, self.cpu_fp16):
            if not max_batch or max_batch >= len(prompts):
                return self._generate(prompts, max_new_tokens, s, generator, record_rows or [],
                                      shard)[0]
            return self._in_pieces(prompts, max_new_tokens, s, generator, record_rows or [],
                                   shard, max_batch)

    def _in_pieces(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                   generator: torch.Generator, record_rows: list[int], shard: Shard,
                   max_batch: int) -> Rollout:
        """`_generate` on consecutive pieces of the prompts. A row's random numbers are drawn
        per position for the whole batch (`uniforms`), so each piece starts from the same
        generator state and takes its own rows' numbers; afterwards the generator is where
        the whole batch would have left it: after the longest piece's positions. Every piece
        keeps the whole batch's prompt width, so its products have the whole batch's columns.
        Ranks hold equal numbers of rows, so they cut equal numbers of pieces and stop each
        one together."""
        start, width = generator.get_state(), shard.width or max(map(len, prompts))
        parts, longest, end = [], -1, start
        for a in range(0, len(prompts), max_batch):
            generator.set_state(start)
            b = min(a + max_batch, len(prompts))
            rec = [i - a for i in record_rows if a <= i < b]
            r, steps = self._generate(prompts[a:b], max_new_tokens, s, generator, rec,
                                      Shard(shard.rows[a:b], shard.batch, shard.all_done, width,
                                            shard.fixed_draws))
            if steps > longest:
                longest, end = steps, generator.get_state()
            parts.append((a, r))
        generator.set_state(end)
        T = max(r.completion_ids.shape[1] for _, r in parts)
        wide = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        out = Rollout(torch.cat([r.prompt_ids for _, r in parts]),
                      torch.cat([r.prompt_mask for _, r in parts]),
                      torch.cat([wide(r.completion_ids, self.pad_id) for _, r in parts]),
                      torch.cat([wide(r.completion_mask, 0.0) for _, r in parts]),
                      torch.cat([wide(r.engine_logprobs, 0.0) for _, r in parts]),
                      torch.cat([r.finished for _, r in parts]))
        kept = [(a, r) for a, r in parts if r.dists is not None]
        if kept:
            out.dist_rows = torch.cat([r.dist_rows + a for a, r in kept])
            out.dists = torch.cat([torch.nn.functional.pad(r.dists, (0, 0, 0, T - r.dists.shape[1]))
                                   for _, r in kept])
        return out

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                  generator: torch.Generator, record_rows: list[int], shard: Shard
                  ) -> tuple[Rollout, int]:
        """The rollout, and how many positions were decoded (draws taken per row)."""
        dev = self.device
        ids, mask = left_pad(prompts, self.pad_id, shard.width, dev)
        B = ids.shape[0]
        rows = None if B == shard.batch else torch.tensor(shard.rows)  # once, not per token
        # Preallocated: a growing cache copies every layer's keys and values at every token
        # (what that costs an fp32 decode step: docs/performance.md).
        with dev:  # the cache's bookkeeping tensors too, not only the keys and values
            cache = StaticCache(config=self.model.config,
                                max_cache_len=ids.shape[1] + max_new_tokens)
        pos = positions(mask)
        # Each position's random numbers are drawn and copied to the device before the forward
        # that precedes them is queued: a copy from the host waits for the device's queue, which
        # is empty there (after the stopping check), not in the middle of a forward.
        u = uniforms(generator, shard.batch, rows, dev)
        keep = torch.tensor(record_rows, dtype=torch.long, device=dev) if record_rows else None
        scratch: dict = {}   # engine_attention's key buffer, freed with this rollout
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         **{self.cache_kw: cache}, use_cache=True,
                         logits_to_keep=keep_last(ids.shape[1], 1, dev),
                         parity_kv_len=ids.shape[1], parity_scratch=scratch)
        tokens = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)
        valid = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        attn, last_pos = mask, pos[:, -1:]
        recorded = []
        for t in range(max_new_tokens):
            x = processed_logits(out.logits[:, -1], s)
            logp = torch.log_softmax(x, dim=-1)
            if keep is not None:
                recorded.append(logp[keep])
            tok = sample_rows(logp, u)
            alive = ~done
            tokens[:, t] = torch.where(alive, tok, self.pad_id)
            logps[:, t] = torch.where(alive, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
            valid[:, t] = alive.float()
            done |= alive & torch.isin(tok, self.eos_ids)
            if shard.all_done(bool(done.all())) or t == max_new_tokens - 1:
                break
            # Finished rows keep decoding a pad token; their output is discarded above. Stopping
            # is the decode loop's one wait for the device (`done.all()` above).
            u = uniforms(generator, shard.batch, rows, dev)
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=tokens[:, t:t + 1], attention_mask=attn,
                             position_ids=last_pos, **{self.cache_kw: cache}, use_cache=True,
                             parity_kv_len=attn.shape[1], parity_scratch=scratch)
        if shard.fixed_draws:
            for _ in range(t + 1, max_new_tokens):
                uniforms(generator, shard.batch)
        T = int(valid.sum(0).nonzero().max()) + 1
        r = Rollout(ids, mask, tokens[:, :T], valid[:, :T], logps[:, :T], done)
        if record_rows:
            r.dist_rows = torch.tensor(record_rows, dtype=torch.long, device=dev)
            r.dists = torch.stack(recorded[:T], dim=1)
        return r, t + 1


def _hf_replica(model: torch.nn.Module, device: torch.device, **kw: Any) -> HFEngine:
    return HFEngine.of_copy(model.to(device), **kw)
