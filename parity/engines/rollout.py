"""What an engine needs to sample beside the log-prob math (parity/logprobs): the random
numbers of each position, drawing a token from them, the rows a rank samples, and the tokens
that end a completion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


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
