"""A mixture of experts' routing figures in ParityGRPOTrainer (docs/moe.md, docs/trl.md): the
routing parity's engine recorded, carried through TRL's batch beside the completions, and
compared with the trainer's own at the loss's forward of a fresh batch (θ = θ_old). TRL's own
vLLM returns no routing, so there are no routing figures with `use_vllm=True`."""

from __future__ import annotations

from typing import Any

import torch

from parity.diagnostics import Attribution
from parity.runs import routing_gap

# The key of TRL's batch dict that carries the engine's routing, [B, P + T, L, k] over
# TRL's own prompt_ids and completion_ids (its split and shuffle keep it aligned with them).
ROUTED = "parity_routed_experts"


class Tracker:
    """What one ParityGRPOTrainer keeps of the routing between TRL's calls."""

    def __init__(self) -> None:
        self.turn: tuple[torch.Tensor, int] | None = None   # the last turn's record, its P
        self.loss: torch.Tensor | None = None               # the loss call's batch record

    def note(self, routed: torch.Tensor | None, prompt_width: int) -> None:
        self.turn = None if routed is None else (routed, prompt_width)

    def batch(self, prompt_ids: torch.Tensor, completion_ids: torch.Tensor
              ) -> torch.Tensor | None:
        """The last turn's record in TRL's batch layout (`place`), once."""
        if self.turn is None:
            return None
        routed, Pr = self.turn
        self.turn = None
        return place(routed, Pr, prompt_ids, completion_ids)


def place(routed: torch.Tensor, Pr: int, prompt_ids: torch.Tensor,
          completion_ids: torch.Tensor) -> torch.Tensor | None:
    """The record [B, Pr + Tr, L, k] of prompts left-padded to Pr in the layout of TRL's
    batch: prompts left-padded to P (TRL may pad to a multiple), completions cut or padded to
    T, the unknown mark where the record has nothing. None if its rows are not TRL's."""
    if routed.shape[0] != prompt_ids.shape[0]:
        return None
    P, T, B = prompt_ids.shape[1], completion_ids.shape[1], routed.shape[0]
    mark = torch.iinfo(routed.dtype).max
    out = torch.full((B, P + T, *routed.shape[2:]), mark, dtype=routed.dtype)
    n = min(P, Pr)
    out[:, P - n:P] = routed[:, Pr - n:Pr].cpu()
    t = min(T, routed.shape[1] - Pr)
    out[:, P:P + t] = routed[:, Pr:Pr + t].cpu()
    return out.to(prompt_ids.device)


def tally(engine: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor],
          prompt_mask: torch.Tensor, mask: torch.Tensor, experts: int, beta: torch.Tensor,
          phantom: torch.Tensor, pi: torch.Tensor, mu: torch.Tensor) -> routing_gap.Tally:
    """One micro-batch's sums: the engine's record and the trainer's own routing and margins
    (TRL's layout, [b, P + T, L, k] and [b, P + T, L]), TRL's prompt mask [b, P], and the
    per-token completion mask, β, phantom clips and log-probs [b, T]."""
    ids, margins = own
    return routing_gap.Tally().add(engine.cpu(), ids.cpu(), margins.cpu(), prompt_mask.cpu(),
                                   mask.float().cpu(), experts, beta.cpu(), phantom.cpu(),
                                   pi.float().cpu(), mu.float().cpu())


def figures(accelerator: Any, inputs: dict, own: tuple[torch.Tensor, torch.Tensor],
            pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, experts: int,
            att: Attribution) -> dict[str, float]:
    """The `routing/` figures of one micro-batch (`inputs`, TRL's, carrying `ROUTED`), every
    rank's tokens together, as one process holding them all would count them."""
    t = tally(inputs[ROUTED], own, inputs["prompt_mask"], mask, experts, att.beta, att.phantom,
              pi, mu).as_tensor()
    if accelerator.num_processes > 1:
        t = accelerator.gather(t.to(accelerator.device)).view(accelerator.num_processes,
                                                              -1).sum(0).cpu()
    return routing_gap.Tally.of_tensor(t).metrics()
