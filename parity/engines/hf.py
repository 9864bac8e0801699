"""The `hf` engine: batched sampling with a KV cache on the engine's own engine-precision copy of
the transformers model, attending with parity's attention (parity/models/attention.py)."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from transformers import StaticCache

from parity.engines.rollout import Shard, sample_rows, uniforms
from parity.logprobs import (
    Rollout,
    Sampling,
    keep_last,
    left_pad,
    log_softmax,
    positions,
    processed_logits,
    prompt_tokens,
    recorded_positions,
    see,
)
from parity.models import routing
from parity.models.forward import score
from parity.models.invariant import engine_attention_of
from parity.models.precision import (
    cast_weights_into,
    copy_bytes,
    fp16_kernels,
    low_precision_copy,
    restore_copy,
    save_copy,
)
from parity.models.trace import hooked, keep, trace
from parity.ui import Ticker


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
        self.model.set_attn_implementation(engine_attention_of(self.model))
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
        with fp16_kernels(self.dtype, self.device, self.cpu_fp16):
            return score(self._scratch, r, s)

    @torch.no_grad()
    def trace(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sequence through the engine's own model on its sampled weights, whole, with its
        attention and precision: every op's output (parity/models/trace.py)."""
        for ids in sequences:
            with fp16_kernels(self.dtype, self.device, self.cpu_fp16):
                yield trace(self.model, ids)

    @torch.no_grad()
    def trace_decode(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sequence's last token as the engine decodes it: the rest prefilled into its KV
        cache, then one decode step, as `generate` runs them; that step's points, one row
        each."""
        dev = self.device
        for ids in sequences:
            x, attn = left_pad([ids[:-1]], self.pad_id, 0, dev)
            pos, n = positions(attn), len(ids) - 1
            cache, scratch = self._cache(len(ids)), {}
            with fp16_kernels(self.dtype, dev, self.cpu_fp16):
                self._forward(x, attn, pos, cache, scratch, logits_to_keep=keep_last(n, 1, dev))
                attn = torch.ones((1, n + 1), dtype=attn.dtype, device=dev)
                with hooked(self.model, 1) as out:
                    logits = self._forward(torch.tensor([ids[-1:]], device=dev), attn,
                                           pos[:, -1:] + 1, cache, scratch)
            out["logits"] = keep(logits, 1)
            yield out

    def replica(self) -> tuple[Callable[..., HFEngine], dict[str, Any]]:
        return _hf_replica, dict(model=copy.deepcopy(self.model).cpu(), dtype=self.dtype,
                                 eos_id=self.eos_ids.tolist(), pad_id=self.pad_id,
                                 cpu_fp16=self.cpu_fp16)

    def close(self) -> None:
        self._scratch = None

    def save_weights(self, directory: Path) -> None:
        save_copy(self.model, directory)

    def restore_weights(self, master: torch.nn.Module, directory: Path) -> None:
        restore_copy(master, self.model, directory)

    def weight_bytes(self) -> int:
        return copy_bytes(self.model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None, max_batch: int = 0) -> Rollout:
        """Sample one completion per prompt. For the batch rows in `record_rows` the whole
        sampling distribution at the first positions (`recorded_positions`) is kept as well
        (`Rollout.dists`). With a
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
        wide = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)
        out = Rollout(torch.cat([r.prompt_ids for _, r in parts]),
                      torch.cat([r.prompt_mask for _, r in parts]),
                      torch.cat([wide(r.completion_ids, self.pad_id) for _, r in parts]),
                      torch.cat([wide(r.completion_mask, 0.0) for _, r in parts]),
                      torch.cat([wide(r.engine_logprobs, 0.0) for _, r in parts]),
                      torch.cat([r.finished for _, r in parts]))
        if parts[0][1].routed is not None:
            out.routed = torch.cat([r.routed_to(T) for _, r in parts])
        kept = [(a, r) for a, r in parts if r.dists is not None]
        if kept:
            out.dist_rows = torch.cat([r.dist_rows + a for a, r in kept])
            n = max(r.dists.shape[1] for _, r in kept)   # recorded positions, at most T
            out.dists = torch.cat([torch.nn.functional.pad(r.dists, (0, 0, 0, n - r.dists.shape[1]))
                                   for _, r in kept])
        return out

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                  generator: torch.Generator, record_rows: list[int], shard: Shard
                  ) -> tuple[Rollout, int]:
        """The rollout, and how many positions were decoded (draws taken per row)."""
        dev = self.device
        ids, mask = left_pad(prompts, self.pad_id, shard.width, dev)
        B = ids.shape[0]
        # once, not per token; on the generator's device, where `uniforms` indexes its draws
        rows = None if B == shard.batch else torch.tensor(shard.rows, device=generator.device)
        draw = lambda: uniforms(generator, shard.batch, rows, dev)
        cache = self._cache(ids.shape[1] + max_new_tokens)
        attn, pos = mask, positions(mask)
        # Each position's random numbers are drawn and copied to the device before the forward
        # that precedes them is queued: a copy from the host waits for the device's queue, which
        # is empty there (after the stopping check), not in the middle of a forward. The rows to
        # record are copied before it for the same reason.
        u = draw()
        keep = torch.tensor(record_rows, dtype=torch.long, device=dev) if record_rows else None
        scratch: dict = {}   # engine_attention's key buffer, freed with this rollout
        # a mixture of experts' routers record their choice at every forward (a dense model's
        # record is empty and costs nothing)
        with routing.recording(self.model) as routed:
            logits = self._forward(ids, attn, pos, cache, scratch,
                                   logits_to_keep=keep_last(ids.shape[1], 1, dev))
            d = _Decoding.start(ids, mask, max_new_tokens, logits.shape[-1], s, keep, self)
            pos = pos[:, -1:]
            tick = Ticker("rollout", max_new_tokens, "positions")
            for t in range(max_new_tokens):
                tick(t)
                d.sample(t, logits, s, u)
                if shard.all_done(bool(d.done.all())) or t == max_new_tokens - 1:
                    break
                # Finished rows keep decoding a pad token; their output is discarded in
                # `sample`. Stopping is the decode loop's one wait for the device.
                u = draw()
                attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
                pos = pos + 1
                logits = self._forward(d.tokens[:, t:t + 1], attn, pos, cache, scratch)
        if shard.fixed_draws:
            for _ in range(t + 1, max_new_tokens):
                uniforms(generator, shard.batch)
        r = d.rollout(ids, mask)
        if routed.layers:
            r.routed = routed.sequence(B, ids.shape[1], r.completion_ids.shape[1])
        return r, t + 1

    def _cache(self, length: int) -> StaticCache:
        # Preallocated: a growing cache copies every layer's keys and values at every token
        # (what that costs an fp32 decode step: docs/performance.md).
        with self.device:  # the cache's bookkeeping tensors too, not only the keys and values
            return StaticCache(config=self.model.config, max_cache_len=length)

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
                 cache: StaticCache, scratch: dict, **kw: Any) -> torch.Tensor:
        """[B, V]: the logits after the last of `ids`, their keys and values added to `cache`."""
        return self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                          **{self.cache_kw: cache}, use_cache=True, parity_kv_len=attn.shape[1],
                          parity_scratch=scratch, **kw).logits[:, -1]


@dataclass
class _Decoding:
    """A batch being decoded: what each position has sampled so far, and the buffers the next
    one samples with."""
    tokens: torch.Tensor        # [B, T] long: pad where a row had already finished
    logps: torch.Tensor         # [B, T] the sampled tokens' log-probs, 0 where finished
    valid: torch.Tensor         # [B, T] 1.0 where the row was still alive
    done: torch.Tensor          # [B] bool: the row has sampled an end token
    seen: torch.Tensor | None   # [B, V] bool: what a repetition penalty counts; None without one
    cdf: torch.Tensor           # [B, V] float64: sample_rows's buffer, reused at every position
    keep: torch.Tensor | None   # the rows whose whole distribution is recorded
    pad_id: int
    eos_ids: torch.Tensor
    recorded: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, vocab: int,
              s: Sampling, keep: torch.Tensor | None, engine: HFEngine) -> _Decoding:
        B, dev = ids.shape[0], engine.device
        zeros = lambda: torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)
        return cls(torch.full((B, max_new_tokens), engine.pad_id, dtype=torch.long, device=dev),
                   zeros(), zeros(), torch.zeros(B, dtype=torch.bool, device=dev),
                   prompt_tokens(ids, mask, vocab) if s.penalises else None,
                   torch.empty((B, vocab), dtype=torch.float64, device=dev), keep,
                   engine.pad_id, engine.eos_ids)

    def sample(self, t: int, logits: torch.Tensor, s: Sampling, u: torch.Tensor) -> None:
        """Position t's token for every row from `logits` [B, V] and the uniforms `u`."""
        logp = log_softmax(processed_logits(logits, s, seen=self.seen))
        if self.keep is not None and t < recorded_positions(logp.shape[-1]):
            self.recorded.append(logp[self.keep])
        tok = sample_rows(logp, u, self.cdf)
        alive = ~self.done
        self.tokens[:, t] = torch.where(alive, tok, self.pad_id)
        self.logps[:, t] = torch.where(alive, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
        self.valid[:, t] = alive.float()
        self.done |= alive & torch.isin(tok, self.eos_ids)
        see(self.seen, alive, tok)

    def rollout(self, ids: torch.Tensor, mask: torch.Tensor) -> Rollout:
        """The positions up to the last one any row sampled."""
        T = int(self.valid.sum(0).nonzero().max()) + 1
        r = Rollout(ids, mask, self.tokens[:, :T], self.valid[:, :T], self.logps[:, :T], self.done)
        if self.keep is not None:
            r.dist_rows = self.keep
            r.dists = torch.stack(self.recorded[:T], dim=1)
        return r


def _hf_replica(model: torch.nn.Module, device: torch.device, **kw: Any) -> HFEngine:
    return HFEngine.of_copy(model.to(device), **kw)
