"""A model's log-probs of a rollout's completion tokens: the trainer's forward (ℓ_π, with
gradient), the shadow's (ℓ_s), ℓ_old's, the reference's and the audit's. Scoring uses the
sampling distribution the engine drew from (repetition penalty, temperature, top-k, top-p,
min-p), so ℓ_π and ℓ_μ are log-probs of the same distribution. By default the model's forward
stops at its last hidden state and the log-probs come from it a chunk of tokens at a time
(parity/logprobs/scoring.py): no [tokens, vocabulary] logits for a whole micro-batch."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from parity.errors import ParityError
from parity.logprobs import (
    Rollout,
    Sampling,
    Seen,
    first_seen,
    head_logprobs,
    keep_last,
    logprobs_from_logits,
    positions,
    recorded_positions,
    seen_before,
)
from parity.models import routing
from parity.runs.distributed import sharded
from parity.ui import say

# logprob_chunk's value that scores a whole forward's logits at once, as the model returns them.
WHOLE = -1


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
    logits: torch.Tensor | None         # [k, n, V] raw logits of the rows asked for at their
                                        # first n = recorded_positions, detached
    hidden: torch.Tensor | None = None  # [B, T, d] last hidden state at those positions


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP holds the model as .module


# Positions the check at first use scores both ways: enough to see a scale or a cap.
PROBE_POSITIONS = 4


def _transforms_logits(model: torch.nn.Module) -> bool:
    """The model changes its logits after the output projection (Gemma 2's soft-capping,
    Cohere's and Granite's scales, Falcon-H1's multiplier), so the head alone does not give
    them. Known from the config where it names the change; otherwise measured once per model
    (`head_gives_logits`)."""
    cfg = _unwrapped(model).config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return True
    return not head_gives_logits(model)


@torch.no_grad()
def head_gives_logits(model: torch.nn.Module) -> bool:
    """Whether the model's output projection of its last hidden state is its logits, measured
    on a few positions the first time a model is asked (the answer kept on the model); where it
    is not, one line says so and the model is scored from its own logits."""
    m = _unwrapped(model)
    known = m.__dict__.get("_parity_head_gives_logits")
    if known is not None:
        return known
    dev = next(m.parameters()).device
    ids = (torch.arange(PROBE_POSITIONS, device=dev)[None] + 1) % m.config.vocab_size
    mask = torch.ones_like(ids)
    with _gathered(model):
        h = last_hidden(model, ids, mask)
        head = m.get_output_embeddings()(h)
        own = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=False).logits
    diff = float((head.float() - own.float()).abs().max())
    scale = float(own.float().abs().max())
    same = head.shape == own.shape and diff <= 1e-3 * max(scale, 1e-6)
    m.__dict__["_parity_head_gives_logits"] = same
    if not same:
        say(f"{type(m).__name__}: its logits are not its output projection's (they differ by up "
            f"to {diff:.3g} of {scale:.3g} on {PROBE_POSITIONS} positions): scored from its own "
            f"logits, whole (logprob_chunk={WHOLE})")
    return same


def _check_chunkable(model: torch.nn.Module) -> None:
    if _transforms_logits(model):
        raise ParityError(f"logprob_chunk: {type(_unwrapped(model)).__name__} transforms its "
                          f"logits after the output projection; score it with "
                          f"logprob_chunk={WHOLE}")


def seen_in(r: Rollout, vocab: int, s: Sampling) -> torch.Tensor | None:
    """What a repetition penalty counts at each completion position of `r`, [B, T, V] bool, for
    logits that exist whole anyway; None when `s` has none."""
    if not s.penalises:
        return None
    return seen_before(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, vocab)


def score_full(model: torch.nn.Module, r: Rollout, s: Sampling, hidden: bool = False,
               keep_logits: list[int] | None = None, chunk: int = 0) -> Scored:
    """Full forward over prompt + completion. Besides the log-probs, the detached logits of the
    rows `keep_logits` (for the exact KL, at no extra forward) and, when asked, the last hidden
    state that predicted each completion token (for a value head). Runs with whatever grad mode
    and autocast the caller set.

    chunk >= 0: the forward stops at the last hidden state and the log-probs of the valid
    completion tokens come from the model's output projection `chunk` tokens at a time (0: as
    many as parity/logprobs/scoring.py's budget holds), recomputed in the backward. chunk =
    WHOLE, and the default for a model that transforms its logits after the head: the model's
    own logits for every position at once, [B, T, V]."""
    if chunk == WHOLE or (chunk == 0 and _transforms_logits(model)):
        # by default such a model is scored from its own logits; chunks asked for are refused
        return _score_whole(model, r, s, hidden, keep_logits or [])
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    L, T = ids.shape[1], r.completion_ids.shape[1]
    with routing.replaying(_unwrapped(model), r.routed):   # a record routes the forward (R3)
        h = last_hidden(model, ids, torch.cat([r.prompt_mask, r.completion_mask.long()], dim=1))
    h = h[:, L - T - 1:L - 1]   # position t predicts token t + 1
    head = _head(model)
    logp = _from_hidden(model, head, h, r, s, chunk)
    with torch.no_grad(), _gathered(model):   # the positions an engine records, no more
        logits = (head(h[keep_logits, :recorded_positions(head.weight.shape[0])])
                  if keep_logits else None)
    return Scored(logp, logits, h if hidden else None)


def _from_hidden(model: torch.nn.Module, head: torch.nn.Module, h: torch.Tensor, r: Rollout,
                 s: Sampling, chunk: int) -> torch.Tensor:
    """[B, T] fp32 log-probs of `r`'s valid completion tokens (0 elsewhere) from `h` [B, T, d],
    the last hidden state that predicts each, and `model`'s output projection `head`."""
    valid = r.completion_mask > 0
    rows, pos = valid.nonzero(as_tuple=True)
    seen = (Seen(first_seen(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                            head.weight.shape[0]), rows, pos) if s.penalises else None)
    # FSDP2's head is gathered around each use of it, the backward's recomputation included
    flat = head_logprobs(h[rows, pos], head, r.completion_ids[rows, pos], s, seen, chunk,
                         gather=(lambda: _gathered(model)) if _fsdp(model) else None)
    return torch.zeros(valid.shape, dtype=flat.dtype, device=flat.device).index_put(
        (rows, pos), flat)


def _head(model: torch.nn.Module) -> torch.nn.Module:
    _check_chunkable(model)
    return _unwrapped(model).get_output_embeddings()


def _fsdp(model: torch.nn.Module) -> bool:
    """The model is FSDP2's, which gathers and frees its parameters around each use."""
    return hasattr(_unwrapped(model), "unshard")


@contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    """The model's head with its weight whole inside the block. FSDP2 gathers the root's
    parameters (the head's among them) for the model's forward; the head is used after it, and
    again in the backward, by when they may be sharded: without gradient as the forward
    returns, with it once a state_dict (the shadow's cast) has been read. Gathered here, they
    are sharded again without gradient; with it FSDP's own backward shards them."""
    m = _unwrapped(model)
    gather = _fsdp(model) and sharded(m.get_output_embeddings().weight)
    if gather:
        m.unshard()
    try:
        yield
    finally:
        if gather and not torch.is_grad_enabled():
            m.reshard()


def _score_whole(model: torch.nn.Module, r: Rollout, s: Sampling, hidden: bool,
                 rows: list[int]) -> Scored:
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask.long()], dim=1)
    L, T = ids.shape[1], r.completion_ids.shape[1]
    # logits at position t predict token t+1: keep only those that predict completion tokens.
    with routing.replaying(_unwrapped(model), r.routed):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=False, logits_to_keep=keep_last(L, T + 1, ids.device),
                    output_hidden_states=hidden)
    logits = out.logits[:, :T]
    seen = seen_in(r, logits.shape[-1], s)
    logp = logprobs_from_logits(logits, r.completion_ids, s, seen=seen) * r.completion_mask
    h = out.hidden_states[-1][:, L - T - 1:L - 1] if hidden else None
    kept = logits[rows, :recorded_positions(logits.shape[-1])].detach() if rows else None
    return Scored(logp, kept, h)


def last_hidden(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, d]: the last hidden state (after the final norm) at every position, from the
    model's own forward, which computes no logits."""
    with _decoder_output(model) as out:
        # The forward goes through the model itself (DDP, FSDP and peft see their own call);
        # keeping no position's logits leaves its head an empty product.
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
              use_cache=False, logits_to_keep=keep_last(ids.shape[1], 0, ids.device))
    return out[0]


@contextmanager
def _decoder_output(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that holds, after the forward inside the block, the output of the model's
    decoder (transformers' `get_decoder()`: the body the head reads)."""
    got: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, out: object) -> None:
        got.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

    handle = _unwrapped(model).get_decoder().register_forward_hook(keep)
    try:
        yield got
    finally:
        handle.remove()


def score_right_padded(model: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
    """`score` with each row's tokens at the left and the padding at the right, as trainers that
    pack without left padding lay a batch out: the same tokens at the same positions, another
    layout of the batch ([B, T] fp32), scored from the last hidden state as `score_full` does."""
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
    # row b's completion token j is predicted at position plen[b] - 1 + j
    at = (plen - 1)[:, None] + torch.arange(T, device=ids.device)[None]
    if _transforms_logits(model):   # its own logits, whole, as score_full scores it
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                       use_cache=False).logits
        logits = logits.gather(1, at[..., None].expand(B, T, logits.shape[-1]))
        seen = seen_in(r, logits.shape[-1], s)
        return logprobs_from_logits(logits, r.completion_ids, s, seen=seen) * r.completion_mask
    h = last_hidden(model, ids, mask)
    h = h.gather(1, at[..., None].expand(B, T, h.shape[-1]))
    return _from_hidden(model, _head(model), h, r, s, 0)


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
                   r.completion_mask[:, :t1], r.engine_logprobs[:, :t1], r.finished,
                   routed=r.routed[:, p0:P + t1] if r.routed is not None else None)


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
