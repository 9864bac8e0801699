"""Policy objectives, each next to its equation, in DESIGN.md's notation.

Shapes: [B, T] per completion token, with `mask` 1 on valid tokens; [B] per completion.
ℓ_π = trainer log-prob (with grad), ℓ_μ = engine log-prob, A = advantage.
"""

from __future__ import annotations

import math

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                    eps: float = 1e-4) -> torch.Tensor:
    """A_i = (R_i − mean_g R) / (std_g R + eps) over each group g of `group_size` completions of
    one prompt (consecutive in `rewards`); with scale=False only the centring (Dr.GRPO).
    std is the unbiased sample std, as TRL computes it."""
    r = rewards.view(-1, group_size).double()
    a = r - r.mean(-1, keepdim=True)
    if scale:
        a = a / (r.std(-1, keepdim=True) + eps)
    return a.view(-1).float()


def clip_predicate(log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float | None,
                   eps_high: float | None) -> torch.Tensor:
    """C(x, A) = (A > 0 and x > log(1 + ε_high)) or (A < 0 and x < log(1 − ε_low)): the tokens
    where PPO's min(r·A, clip(r)·A) takes the clipped branch and the gradient is 0."""
    hi = math.log1p(eps_high) if eps_high is not None else math.inf
    lo = math.log1p(-eps_low) if eps_low is not None else -math.inf
    return ((adv > 0) & (log_ratio > hi)) | ((adv < 0) & (log_ratio < lo))


def ppo_clip_token_loss(log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float | None,
                        eps_high: float | None) -> torch.Tensor:
    """Per-token PPO-clip loss  −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A),  r = exp(log r).
    `adv` broadcasts over tokens ([B, 1] for sequence-level GRPO advantages)."""
    r = torch.exp(log_ratio)
    lo = 1 - eps_low if eps_low is not None else 0.0
    hi = 1 + eps_high if eps_high is not None else math.inf
    return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)


def seq_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO's aggregation: token mean within each completion, then mean over completions."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def ppo_clip_loss(logp_pi: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor, eps_low: float | None, eps_high: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO-clip with GRPO advantages. `logp_old` is the ratio's denominator as the
    ratio source chose it (ℓ_μ for `engine`). Returns (loss, clipped mask)."""
    log_ratio = logp_pi - logp_old
    a = adv[:, None]
    loss = seq_mean(ppo_clip_token_loss(log_ratio, a, eps_low, eps_high), mask)
    clipped = clip_predicate(log_ratio.detach(), a, eps_low, eps_high) & (mask > 0)
    return loss, clipped
