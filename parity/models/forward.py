"""A model's log-probs of a rollout's completion tokens: the trainer's forward (ℓ_π, with
gradient), the shadow's (ℓ_s) and the audit's. Scoring uses the sampling distribution the engine
drew from (repetition penalty, temperature, top-k, top-p, min-p), so ℓ_π and ℓ_μ are log-probs
of the same distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from parity.engines.rollout import (
    Rollout,
    Sampling,
    keep_last,
    logprobs_from_logits,
    positions,
    seen_before,
)
from parity.errors import ParityError


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
    logits: torch.Tensor | None         # [k, T, V] raw logits of the rows asked for, detached
    hidden: torch.Tensor | None = None  # [B, T, d] last hidden state at those positions


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP holds the model as .module


def _check_chunkable(model: torch.nn.Module) -> None:
    cfg = _unwrapped(model).config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        raise ParityError(f"logprob_chunk: {type(_unwrapped(model)).__name__} transforms its "
                          f"logits after the output projection; score it with logprob_chunk=0")


def _chunk_logp(head: torch.nn.Module, h: torch.Tensor, tokens: torch.Tensor,
                s: Sampling, seen: torch.Tensor | None) -> torch.Tensor:
    return logprobs_from_logits(head(h), tokens, s, seen=seen)


def seen_in(r: Rollout, vocab: int, s: Sampling) -> torch.Tensor | None:
    """What a repetition penalty counts at each completion position of `r` (`seen_before`);
    None when `s` has none."""
    if not s.penalises:
        return None
    return seen_before(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, vocab)


def score_full(model: torch.nn.Module, r: Rollout, s: Sampling, hidden: bool = False,
               keep_logits: list[int] | None = None, chunk: int = 0) -> Scored:
    """Full forward over prompt + completion. Besides the log-probs, the detached logits of the
    rows `keep_logits` (for the exact KL, at no extra forward) and, when asked, the last hidden
    state that predicted each completion token (for a value head). Runs with whatever grad mode
    and autocast the caller set.

    chunk > 0: the output projection runs `chunk` positions at a time and each chunk's
    vocabulary-wide logits are recomputed in the backward rather than kept, so no [B, T, V]
    tensor ever exists (the LM head's input is the last hidden state, as in the model's own
    forward)."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask.long()], dim=1)
    L, T = ids.shape[1], r.completion_ids.shape[1]
    rows = keep_logits or []
    if not chunk:
        # logits at position t predict token t+1: keep only those that predict completion tokens.
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=False, logits_to_keep=keep_last(L, T + 1, ids.device),
                    output_hidden_states=hidden)
        logits = out.logits[:, :T]
        seen = seen_in(r, logits.shape[-1], s)
        logp = logprobs_from_logits(logits, r.completion_ids, s, seen=seen) * r.completion_mask
        h = out.hidden_states[-1][:, L - T - 1:L - 1] if hidden else None
        return Scored(logp, logits[rows].detach() if rows else None, h)
    _check_chunkable(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                use_cache=False, logits_to_keep=1, output_hidden_states=True)
    h = out.hidden_states[-1][:, L - T - 1:L - 1]
    head = _unwrapped(model).get_output_embeddings()
    seen = seen_in(r, head.weight.shape[0], s)
    parts = []
    for a in range(0, T, chunk):
        hc, tc = h[:, a:a + chunk], r.completion_ids[:, a:a + chunk]
        sc = None if seen is None else seen[:, a:a + chunk]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logp, head, hc, tc, s, sc, use_reentrant=False))
        else:
            parts.append(_chunk_logp(head, hc, tc, s, sc))
    logp = torch.cat(parts, dim=1) * r.completion_mask
    with torch.no_grad():
        logits = head(h[rows]) if rows else None
    return Scored(logp, logits, h if hidden else None)


def score_right_padded(model: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
    """`score` with each row's tokens at the left and the padding at the right, as trainers that
    pack without left padding lay a batch out: the same tokens at the same positions, another
    layout of the batch ([B, T] fp32). The logits come from the model's own forward and head, as
    in `score_full`, kept from the first position any row needs."""
    plen = r.prompt_mask.sum(-1).long()
    B, T = r.completion_ids.shape
    P = int(plen.max())
    ids = r.completion_ids.new_full((B, P + T), 0)
    mask = torch.zeros_like(ids)
    for b in range(B):
        n = int(plen[b])
        ids[b, :n] = r.prompt_ids[b, r.prompt_ids.shape[1] - n:]
        ids[b, n:n + T] = r.completion_ids[b]
        mask[b, :n], mask[b, n:n + T] = 1, r.completion_mask[b].long()
    first = int(plen.min()) - 1        # the first position whose logits predict a completion token
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                use_cache=False, logits_to_keep=keep_last(P + T, P + T - first, ids.device))
    # row b's completion token j is predicted at position plen[b] - 1 + j
    at = (plen - 1 - first)[:, None] + torch.arange(T, device=ids.device)[None]
    logits = out.logits.gather(1, at[..., None].expand(B, T, out.logits.shape[-1]))
    seen = seen_in(r, logits.shape[-1], s)
    return logprobs_from_logits(logits, r.completion_ids, s, seen=seen) * r.completion_mask


def score(model: torch.nn.Module, r: Rollout, s: Sampling, chunk: int = 0) -> torch.Tensor:
    """Log-probs of the completion tokens, [B, T] fp32 (see `score_full`)."""
    return score_full(model, r, s, chunk=chunk).logp


# ---- micro-batches ----------------------------------------------------------------------------

def _lengths(r: Rollout) -> tuple[list[int], list[int]]:
    return r.prompt_mask.sum(-1).long().tolist(), r.completion_mask.sum(-1).long().tolist()


def pieces(r: Rollout, rows: int = 0, tokens: int = 0, group: int = 1, count: int = 0
           ) -> list[slice]:
    """Consecutive row slices of `r` that together cover it, each of whole groups of `group`
    rows, at most `rows` rows (0: no limit) and, as far as whole groups allow, at most `tokens`
    positions once trimmed (rows x (longest prompt + longest completion) of the slice; 0: no
    limit). `count` > 0 splits further, largest slice first, until there are that many: every
    rank must run as many forwards as the others."""
    B = r.completion_ids.shape[0]
    if not rows and not tokens and count <= 1:
        return [slice(0, B)]
    plen, clen = _lengths(r)
    out: list[list[int]] = []  # [start, end) pairs
    for g in range(0, B, group):
        end = min(g + group, B)
        if out:
            a = out[-1][0]
            n = end - a
            cost = n * (max(plen[a:end]) + max(clen[a:end]))
            if (not rows or n <= rows) and (not tokens or cost <= tokens):
                out[-1][1] = end
                continue
        out.append([g, end])
    while len(out) < count:
        splittable = [p for p in out if p[1] - p[0] > group]
        if not splittable:
            break
        big = max(splittable, key=lambda p: p[1] - p[0])
        mid = big[0] + (big[1] - big[0]) // group // 2 * group
        mid = max(mid, big[0] + group)
        out.insert(out.index(big) + 1, [mid, big[1]])
        big[1] = mid
    return [slice(a, b) for a, b in out]


def trimmed(r: Rollout) -> Rollout:
    """`r` without the prompt columns that are padding in every row and the completion columns
    past its longest completion: the same tokens at the same positions, in a smaller forward."""
    plen, clen = _lengths(r)
    P = r.prompt_ids.shape[1]
    p0, t1 = P - max(plen), max(max(clen), 1)
    return Rollout(r.prompt_ids[:, p0:], r.prompt_mask[:, p0:], r.completion_ids[:, :t1],
                   r.completion_mask[:, :t1], r.engine_logprobs[:, :t1], r.finished)


def widened(x: torch.Tensor, T: int) -> torch.Tensor:
    """[b, t, ...] padded with zeros to [b, T, ...]: a trimmed piece's output in the batch's
    shape."""
    n = T - x.shape[1]
    if n <= 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], n, *x.shape[2:])], dim=1)


@torch.no_grad()
def score_pieces(model: torch.nn.Module, r: Rollout, s: Sampling, slices: list[slice],
                 hidden: bool = False, chunk: int = 0) -> Scored:
    """`score_full` without gradient, one forward per slice (trimmed), put back together."""
    if len(slices) == 1 and slices[0] == slice(0, r.completion_ids.shape[0]):
        return score_full(model, r, s, hidden, chunk=chunk)
    T = r.completion_ids.shape[1]
    parts = [score_full(model, trimmed(r.select(sl)), s, hidden, chunk=chunk) for sl in slices]
    return Scored(torch.cat([widened(p.logp, T) for p in parts]), None,
                  torch.cat([widened(p.hidden, T) for p in parts]) if hidden else None)
