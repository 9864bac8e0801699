"""The batch of completions an engine returns and the trainer scores, and how its tokens are
laid out: prompts left-padded, completions right-padded, positions that ignore the padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # The engine's whole sampling distribution at the first positions of a few rows, for the exact
    # KL(μ‖π): `dist_rows` [k] indexes the batch, `dists` [k, n, V] fp32 log-probs at positions
    # 0..n-1 (n: `recorded_positions`, or T where that is fewer; a row's valid ones count).
    dist_rows: torch.Tensor | None = None
    dists: torch.Tensor | None = None
    # A mixture of experts' routing as the engine ran it: [B, P + T, L, k] expert ids per
    # position (prompt columns, then completion columns) and MoE layer, in the narrowest integer
    # type; an id at or above the expert count where unknown (parity/models/routing.py).
    routed: torch.Tensor | None = None

    _BATCHED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                "engine_logprobs", "finished")

    def select(self, idx: torch.Tensor | slice) -> "Rollout":
        """The completions `idx` picks (the recorded distributions stay with the full batch)."""
        return Rollout(*(getattr(self, f)[idx] for f in self._BATCHED),
                       routed=self.routed[idx] if self.routed is not None else None)

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
                       self.finished, self.dist_rows, self.dists, self.routed_to(T))

    def routed_to(self, T: int) -> torch.Tensor | None:
        """`routed` for T completion columns: cut, or padded with the unknown mark."""
        if self.routed is None:
            return None
        keep = self.prompt_ids.shape[1] + T
        r = self.routed[:, :keep]
        if r.shape[1] < keep:
            fill = torch.iinfo(r.dtype).max
            r = torch.cat([r, r.new_full((r.shape[0], keep - r.shape[1], *r.shape[2:]), fill)],
                          dim=1)
        return r

    def to(self, device: torch.device) -> "Rollout":
        """The rollout on `device` (one from another process, or from vLLM, arrives on the CPU)."""
        move = lambda x: x.to(device) if x is not None else None
        return Rollout(*(move(getattr(self, f)) for f in self._BATCHED), move(self.dist_rows),
                       move(self.dists), move(self.routed))

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
