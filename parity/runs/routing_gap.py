"""The routing gap of a mixture of experts: where the trainer's routers chose other experts than
the engine's did for the same tokens, and what those flips do to β, the phantom clips and the
KL (docs/moe.md). Counts add up over batches (`Tally`), so an audit's figures are its whole
sample's, not a mean of batch means. The records come from parity/models/routing.py."""

from __future__ import annotations

from collections import defaultdict

import torch

from parity import metric_names as mn
from parity.models import routing
from parity.runs.finite import usable_tokens


def flipped(engine: torch.Tensor, trainer: torch.Tensor, prompt_mask: torch.Tensor,
            completion_mask: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input position of [prompt, completion] ([B, S]): which positions count (a real
    token whose engine record is known) and, per MoE layer, which of them the trainer routed to
    other experts ([B, S, L] bool, False where a position does not count)."""
    counted = (torch.cat([prompt_mask.bool(), completion_mask > 0], dim=1)
               & routing.known(engine, experts).all(-1))
    return counted, routing.decisions_differ(engine, trainer) & counted[..., None]


# The sums a Tally keeps besides its per-layer flips.
KEYS = ("positions", "margin", "margin_flips", "tokens", "flipped", "beta_tokens",
        "beta_flipped", "phantom_tokens", "phantom_flipped", "k3_tokens", "k3_flipped")


class Tally:
    """Sums of one or more batches, from which the `routing/` figures follow."""

    def __init__(self) -> None:
        self.n: dict[str, float] = defaultdict(float)
        self.layers: list[float] = []

    def add(self, engine: torch.Tensor, trainer: torch.Tensor, margins: torch.Tensor,
            prompt_mask: torch.Tensor, completion_mask: torch.Tensor, experts: int,
            beta: torch.Tensor, phantom: torch.Tensor, logp_pi: torch.Tensor,
            logp_mu: torch.Tensor) -> "Tally":
        """One batch: the engine's record and the trainer's own choice, [B, S, L, k], the
        trainer's top-k margins [B, S, L], and the per-token β, phantom clips and log-probs
        [B, T]. A completion token has a flip where the position that predicts it (the token
        before it) flipped in any layer."""
        # the tokens every other figure counts: a NaN, inf or positive log-prob is left out
        # (the step's diagnostics count and warn of it once)
        completion_mask, (logp_pi, logp_mu), _ = usable_tokens(completion_mask, logp_pi,
                                                               logp_mu)
        counted, flips = flipped(engine, trainer, prompt_mask, completion_mask, experts)
        n, per_layer = self.n, flips.sum((0, 1)).tolist()
        self.layers = [a + b for a, b in zip(self.layers, per_layer)] or per_layer
        n["positions"] += float(counted.sum())
        n["margin"] += float(margins[counted].double().sum())
        n["margin_flips"] += float(margins[flips].double().sum())
        P, T = prompt_mask.shape[1], completion_mask.shape[1]
        tok = counted[:, P - 1:P - 1 + T] & (completion_mask > 0)
        tflip = flips[:, P - 1:P - 1 + T].any(-1) & tok
        b = beta.detach().abs().double()
        d = (logp_pi.detach() - logp_mu).double().clamp(max=80.0)
        k3 = d.exp() - d - 1
        for key, where in (("tokens", tok), ("flipped", tflip)):
            n[key] += float(where.sum())
            n[f"beta_{key}"] += float(b[where].sum())
            n[f"phantom_{key}"] += float(phantom[where].sum())
            n[f"k3_{key}"] += float(k3[where].sum())
        return self

    def as_tensor(self) -> torch.Tensor:
        """The sums as one float64 vector (`KEYS`, then the layers'), to add across ranks."""
        return torch.tensor([self.n[k] for k in KEYS] + self.layers, dtype=torch.float64)

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> "Tally":
        """The Tally `as_tensor` gave (or a sum of such vectors, one per rank)."""
        out, vals = cls(), t.tolist()
        out.n.update(zip(KEYS, vals))
        out.layers = vals[len(KEYS):]
        return out

    def by_layer(self) -> list[float]:
        """The share of decisions that flipped in each MoE layer (empty before any batch)."""
        n = self.n["positions"]
        return [f / n for f in self.layers] if n else []

    def metrics(self) -> dict[str, float]:
        n, L = self.n, len(self.layers)
        if not n["positions"] or not L:
            return {}
        flips = sum(self.layers)
        out = {mn.ROUTING_FLIP_FRAC: flips / (n["positions"] * L),
               mn.ROUTING_MARGIN_MEAN: n["margin"] / (n["positions"] * L)}
        out.update({mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j): f / n["positions"]
                    for j, f in enumerate(self.layers)})
        if flips:
            out[mn.ROUTING_MARGIN_AT_FLIPS] = n["margin_flips"] / flips
        if not n["tokens"]:
            return out
        unflipped = n["tokens"] - n["flipped"]
        out[mn.ROUTING_TOKEN_FLIP_FRAC] = n["flipped"] / n["tokens"]
        if n["flipped"]:
            out[mn.ROUTING_BETA_ABS_FLIPPED] = n["beta_flipped"] / n["flipped"]
        if unflipped:
            out[mn.ROUTING_BETA_ABS_UNFLIPPED] = (n["beta_tokens"] - n["beta_flipped"]) / unflipped
        if n["phantom_tokens"]:
            out[mn.ROUTING_PHANTOM_FLIPPED_SHARE] = n["phantom_flipped"] / n["phantom_tokens"]
        if n["k3_tokens"] > 0:
            out[mn.ROUTING_KL_K3_FLIPPED_SHARE] = n["k3_flipped"] / n["k3_tokens"]
        return out


def figures(*batch: torch.Tensor | int) -> dict[str, float]:
    """The `routing/` figures of one batch (`Tally.add`'s arguments)."""
    return Tally().add(*batch).metrics()
