"""The repetition penalty's bookkeeping: which tokens count as seen before each position.

A row's penalty counts the tokens of its prompt (not its padding: a row's distribution does not
depend on the batch it was padded in, as in vLLM) and of its completion before the position.
Scoring keeps, per row, the first position at which each token is seen ([rows, vocabulary]
integers) and expands it a chunk of positions at a time, so no [tokens, vocabulary] mask exists
for a whole batch. Decoding keeps one [rows, vocabulary] mask and adds each sampled token to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def first_seen(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               completion_ids: torch.Tensor, completion_mask: torch.Tensor, vocab: int
               ) -> torch.Tensor:
    """[B, V] int32: the first completion position at which each token is seen, -1 for a token
    of the row's prompt, T (the completion width) for one never seen."""
    B, T = completion_ids.shape
    dev = completion_ids.device
    first = torch.full((B, vocab + 1), T, dtype=torch.int32, device=dev)
    at = torch.arange(T, device=dev, dtype=torch.int32).expand(B, T).masked_fill(
        completion_mask == 0, T)
    first.scatter_reduce_(1, completion_ids.clamp(max=vocab), at, reduce="amin")
    prompt = torch.where(prompt_mask > 0, -1, T).to(torch.int32).expand_as(prompt_ids)
    first.scatter_reduce_(1, prompt_ids.clamp(max=vocab), prompt, reduce="amin")
    return first[:, :vocab].contiguous()


@dataclass(frozen=True)
class Seen:
    """What a repetition penalty counts at each of N scored tokens: token n sits in row
    `rows[n]` at completion position `pos[n]`; `first` is `first_seen` of the batch."""
    first: torch.Tensor   # [B, V] int32
    rows: torch.Tensor    # [N] long
    pos: torch.Tensor     # [N] long

    def at(self, a: int, b: int) -> torch.Tensor:
        """[b - a, V] bool: the tokens seen before scored tokens a..b-1."""
        return self.first[self.rows[a:b]] < self.pos[a:b, None]


def seen_before(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                completion_ids: torch.Tensor, completion_mask: torch.Tensor, vocab: int
                ) -> torch.Tensor:
    """[B, T, V] bool: at completion position t, the tokens a repetition penalty counts there.
    For callers that hold [B, T, V] logits anyway (TRL's own forward)."""
    first = first_seen(prompt_ids, prompt_mask, completion_ids, completion_mask, vocab)
    T = completion_ids.shape[1]
    return first[:, None, :] < torch.arange(T, device=first.device)[None, :, None]


def prompt_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: the tokens of each prompt, its padding excepted (what a repetition penalty
    counts before the first sampled token)."""
    seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, ids.clamp(max=vocab).masked_fill(mask == 0, vocab), True)
    return seen[:, :vocab].contiguous()


def see(seen: torch.Tensor | None, alive: torch.Tensor, tok: torch.Tensor) -> None:
    """Each live row's new token counts as seen from the next position on."""
    if seen is not None:
        seen[alive, tok[alive]] = True
