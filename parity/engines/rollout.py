"""The sampling distribution every engine and the trainer share, and the batch of completions
an engine returns.

Every engine records, for every sampled token, ℓ_μ: its log-prob under the distribution actually
sampled from (repetition penalty, temperature, top-k, top-p and min-p applied, renormalised).
The trainer scores tokens with the same `logprobs_from_logits`, so with equal weights and equal
precision ℓ_π = ℓ_μ up to kernel noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# top_p=0 keeps the likeliest token alone, as transformers' top-p does (min_tokens_to_keep=1).
# vLLM refuses 0 (its range is (0, 1]) but, like parity and transformers, keeps exactly the
# likeliest token at any top_p below that token's probability, which is at least 1/vocabulary:
# this one value means the same to every engine.
TOP_TOKEN_ONLY = 1e-9


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.top_p == 0:
            object.__setattr__(self, "top_p", TOP_TOKEN_ONLY)

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def penalises(self) -> bool:
        """A token's logit depends on the tokens before it, not on the model alone."""
        return self.repetition_penalty != 1.0


def processed_logits(logits: torch.Tensor, s: Sampling, keep: torch.Tensor | None = None,
                     seen: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits of the sampling distribution, in transformers' order: the repetition penalty,
    temperature, top-k, top-p, min-p; removed tokens get -inf. The penalty divides a positive
    logit and multiplies a negative one for every token in `seen` (bool, the shape of `logits`:
    the tokens of the row's prompt, its padding excepted, and of its completion before this
    position, `seen_before`). `keep` (token ids, shape logits[..., 0]) is never removed: the
    trainer must not score a token the engine really sampled as impossible just because its own
    logits put it a hair outside the nucleus."""
    x = logits.float()
    if s.penalises:
        if seen is None:
            raise ValueError("a repetition penalty needs the tokens seen before each position")
        p = s.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if s.temperature != 1.0:   # at 1 a division would copy [B, T, V] (2.3 GiB at Qwen3's shape)
        x = x / s.temperature
    if not s.truncates:
        return x
    remove = torch.zeros_like(x, dtype=torch.bool)
    if s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        remove |= x < kth
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x.masked_fill(remove, float("-inf")), dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        cut = probs.cumsum(-1) - probs >= s.top_p
        cut[..., 0] = False   # the likeliest token stays, whatever top_p (transformers' rule)
        remove |= torch.zeros_like(remove).scatter(-1, order, cut)
    if s.min_p > 0.0:
        probs = x.masked_fill(remove, float("-inf")).softmax(-1)
        remove |= probs < s.min_p * probs.amax(-1, keepdim=True)
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return x.masked_fill(remove, float("-inf"))


# Without gradient, vocabulary-wide work takes a few positions at a time: a float32 temporary of
# 8 MiB is memory the allocator hands back at once, where one over a whole micro-batch ([B, T, V]:
# 0.6 GB at Qwen3's vocabulary, and the log-sum-exp makes two more) is fresh memory each time, on
# a CPU slower to fill than the arithmetic is to run (docs/performance.md). At least a position
# per thread: each position's reductions then run as they do over the whole tensor, to the bit.
CHUNK_BYTES = 8 << 20
# On a GPU the caching allocator reuses memory anyway, and each chunk is several kernel launches:
# chunks there only bound the temporaries' memory.
DEVICE_CHUNK_BYTES = 256 << 20


def row_chunk(vocab: int, device: torch.device | None = None) -> int:
    """Positions of a vocabulary-wide computation without gradient that run at once on
    `device` (the CPU when None)."""
    if device is not None and device.type != "cpu":
        return max(DEVICE_CHUNK_BYTES // (4 * vocab), 1)
    return max(CHUNK_BYTES // (4 * vocab), torch.get_num_threads(), 1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling,
                         keep_sampled: bool = True, seen: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """log p(token) under the sampling distribution defined by `s`; fp32, shape of `tokens`.
    `seen`: as `processed_logits` needs it with a repetition penalty. Without gradient the
    positions run `row_chunk` at a time, with the same result."""
    if (torch.is_grad_enabled() and logits.requires_grad) or tokens.dim() == 0:
        return _logprobs(logits, tokens, s, keep_sampled, seen)
    x, tok = logits.reshape(-1, *logits.shape[-2:]), tokens.reshape(-1, tokens.shape[-1])
    sn = None if seen is None else seen.reshape(x.shape)
    out = torch.empty(tok.shape, dtype=torch.float32, device=logits.device)
    c = row_chunk(logits.shape[-1], logits.device)
    for b in range(x.shape[0]):
        for a in range(0, x.shape[1], c):
            out[b, a:a + c] = _logprobs(x[b, a:a + c], tok[b, a:a + c], s, keep_sampled,
                                        None if sn is None else sn[b, a:a + c])
    return out.reshape(tokens.shape)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling, keep_sampled: bool,
              seen: torch.Tensor | None) -> torch.Tensor:
    x = processed_logits(logits, s, keep=tokens if keep_sampled else None, seen=seen)
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def seen_before(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                completion_ids: torch.Tensor, completion_mask: torch.Tensor, vocab: int
                ) -> torch.Tensor:
    """[B, T, V] bool: at completion position t, the tokens a repetition penalty counts there,
    those of the row's prompt (not its padding: a row's distribution does not depend on the
    batch it was padded in, as in vLLM) and of its completion before t."""
    B, T = completion_ids.shape
    dev = completion_ids.device
    # the first position at which each token is seen: -1 in the prompt, T if never
    first = torch.full((B, vocab + 1), T, dtype=torch.long, device=dev)
    at = torch.arange(T, device=dev).expand(B, T).masked_fill(completion_mask == 0, T)
    first.scatter_reduce_(1, completion_ids.clamp(max=vocab), at, reduce="amin")
    first.scatter_reduce_(1, prompt_ids.clamp(max=vocab),
                          torch.where(prompt_mask > 0, -1, T).expand_as(prompt_ids), reduce="amin")
    return first[:, None, :vocab] < torch.arange(T, device=dev)[None, :, None]


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
        move = lambda x: x.to(device) if x is not None else None
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


def sample_rows(logp: torch.Tensor, u: torch.Tensor, cdf: torch.Tensor | None = None
                ) -> torch.Tensor:
    """One token per row of `logp` [B, V], drawn from exp(logp) by inverse CDF with the uniforms
    `u` [B, 1]. torch.multinomial draws an exponential per vocabulary entry instead, B·V random
    numbers a token, a large share of a decode step (docs/performance.md). The CDF
    is summed in float64 so a token's share of [0, 1) is its probability to ~1e-16.

    `cdf`: a float64 buffer of `logp`'s shape that the CDF is summed in, the same at every
    position of a decode loop. Three fresh [B, V] float64 tensors a position (19 MB each at
    16 rows of 151,936 tokens) were, depending on what the allocator held, fresh pages each
    time, and the same CPU rollout took up to twice as long (docs/performance.md)."""
    c = torch.empty_like(logp, dtype=torch.float64) if cdf is None else cdf
    c.copy_(logp).exp_().cumsum_(-1)
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
