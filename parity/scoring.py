"""A model's log-probs of a rollout's completion tokens: the trainer's forward (ℓ_π, with
gradient), the shadow's (ℓ_s) and the audit's. Scoring uses the sampling distribution the engine
drew from (temperature, top-k, top-p), so ℓ_π and ℓ_μ are log-probs of the same distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.engines import Rollout, Sampling, keep_last, logprobs_from_logits, positions


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout off in every forward that enters a ratio: with it on, ℓ_π (and ℓ_old) carry
    dropout noise that the diagnostics would report as precision gap β (docs/design.md).
    Dropout modules get p = 0, and attention layers that apply dropout functionally (Llama,
    Qwen2: an `attention_dropout` rate) get a rate of 0; train mode is kept."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


@dataclass
class Scored:
    logp: torch.Tensor                  # [B, T] fp32 log-probs of the completion tokens
    logits: torch.Tensor                # [B, T, V] raw logits that predicted them, detached
    hidden: torch.Tensor | None = None  # [B, T, d] last hidden state at those positions


def score_full(model: torch.nn.Module, r: Rollout, s: Sampling, hidden: bool = False) -> Scored:
    """Full forward over prompt + completion. Besides the log-probs, the detached logits (for the
    exact KL, at no extra forward) and, when asked, the last hidden state that predicted each
    completion token (for a value head). Runs with whatever grad mode and autocast the caller set."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask.long()], dim=1)
    L, T = ids.shape[1], r.completion_ids.shape[1]
    # logits at position t predict token t+1: keep only those that predict completion tokens.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                use_cache=False, logits_to_keep=keep_last(L, T + 1), output_hidden_states=hidden)
    logits = out.logits[:, :T]
    logp = logprobs_from_logits(logits, r.completion_ids, s) * r.completion_mask
    h = out.hidden_states[-1][:, L - T - 1:L - 1] if hidden else None
    return Scored(logp, logits.detach(), h)


def score(model: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
    """Log-probs of the completion tokens, [B, T] fp32 (see `score_full`)."""
    return score_full(model, r, s).logp
