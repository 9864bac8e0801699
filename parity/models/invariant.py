"""Zero mismatch: the engine and the trainer compute the same bits (docs/zero-mismatch.md).

Three things make two forwards of the same weights differ on a CPU, and each has its fix here:

- A matrix product's rows depend on how many rows it has: the BLAS takes another kernel, so
  another order of the sums, for a few rows than for many (`python -m bench.row_invariance`).
  A decode step multiplies B rows, the trainer B x T. Every matrix product runs as calls of
  `cpu_bf16.CHUNK` rows, zero rows filling the last, so every call has one shape whatever
  the batch (a bf16 batched product one matrix at a time; an fp32 one, attention's, as one
  call padded to `TILE` rows): parity/cpu_bf16.py installs this with its overrides of aten's
  products.
- Attention sums over the keys, and the engine's decode has t + 1 keys where the trainer's
  forward has the whole sequence, laid out with other padding. `invariant_attention` sums in
  fixed blocks of `BLOCK` keys counted from each row's first token, the blocks one after the
  other: a key the query may not see adds an exact zero, so a query's output does not depend on
  how many keys follow it, nor on the padding before them.
- The trainer computes in fp32 or under autocast, the engine on its own low-precision copy.
  `engine_precision` makes the trainer's forward the copy's: each parameter read as its cast to
  the engine's dtype, so the same ops run on the same values, and the gradient reaches the fp32
  master through the cast.

The log-prob of a token is the same function on both sides: x[token] - logsumexp(x)
(parity/logprobs/scoring.py), whose reduction over the vocabulary depends on the row alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from parity import cpu_bf16
from parity.errors import ParityError
from parity.models.attention import ENGINE_ATTENTION

TILE = 16     # an fp32 batched product's rows, padded to a multiple of this
BLOCK = 64    # keys summed together in attention
QUERIES = 256  # queries whose scores are computed together
INVARIANT_ATTENTION = "parity_invariant"
_MIN = torch.finfo(torch.float32).min


def _allowed(attention_mask: torch.Tensor | None, B: int, q: int, L: int,
             device: torch.device) -> torch.Tensor:
    """[B, q, L] bool: the keys each query may see. Without a mask, causal with the queries last."""
    if attention_mask is None:
        i = torch.arange(q, device=device)[:, None] + (L - q)
        return (torch.arange(L, device=device)[None] <= i)[None].expand(B, q, L)
    return attention_mask[:, 0, -q:, :L].expand(B, q, L) == 0


def invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0,
                        parity_kv_len: int | None = None, parity_scratch: dict | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Softmax attention whose output for a query depends on that query's keys alone.

    Each row's keys are moved to start at slot 0 (its first key the last query sees: left
    padding, and whatever the layout), in blocks of BLOCK. Per block, in fp32 from the model's
    dtype: scores q·k, the scale, keys the query may not see set to fp32's lowest; the max over
    every block; exp; then one product of the block's weights with [v | 1], which gives the
    block's numerator and denominator. The blocks are summed in order (cumsum), so blocks past
    the query's last key, all zero weights, add exact zeros. One rounding to the model's dtype
    at the end. The queries go QUERIES at a time, each block of them recomputed in the backward
    rather than kept (`_attend`), so memory is QUERIES x keys per head, not the sequence
    squared. `parity_kv_len`: the filled part of a static cache (the engine's decode)."""
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None \
            or kwargs.get("sliding_window"):
        raise ParityError("kernels=invariant: capped logits, attention sinks and sliding "
                          "windows are not in parity's invariant attention")
    if parity_kv_len is not None:
        key, value = key[:, :, :parity_kv_len], value[:, :, :parity_kv_len]
    B, H, q, d = query.shape
    kv, L = key.shape[1], key.shape[2]
    dev = query.device
    allowed = _allowed(attention_mask, B, q, L, dev)
    first = allowed[:, -1].int().argmax(-1)                       # [B]
    nb = -(-L // BLOCK)
    slot = first[:, None] + torch.arange(nb * BLOCK, device=dev)[None]   # [B, nb·BLOCK]
    inside = slot < L
    slot = slot.clamp(max=L - 1)
    take = slot[:, None, :, None].expand(B, kv, nb * BLOCK, d)
    keep = inside[:, None, :, None]
    k = torch.where(keep, key.gather(2, take).float(), 0.0).view(B, kv, nb, BLOCK, d)
    v = torch.where(keep, value.gather(2, take).float(), 0.0).view(B, kv, nb, BLOCK, d)
    v1 = torch.cat([v, torch.ones((B, kv, nb, BLOCK, 1), device=dev)], dim=-1)
    seen = allowed.gather(2, slot[:, None].expand(B, q, nb * BLOCK)) & inside[:, None]
    scale = d ** -0.5 if scaling is None else scaling
    keep_graph = torch.is_grad_enabled() and q > QUERIES
    outs = []
    for i in range(0, q, QUERIES):
        args = (query[:, :, i:i + QUERIES], k, v1, seen[:, i:i + QUERIES], scale)
        outs.append(checkpoint(_attend, *args, use_reentrant=False) if keep_graph
                    else _attend(*args))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _attend(query: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, seen: torch.Tensor,
            scale: float) -> torch.Tensor:
    """[B, H, q, d] from queries [B, H, q, d], keys [B, kv, nb, BLOCK, d], [v | 1]
    [B, kv, nb, BLOCK, d + 1] and `seen` [B, q, nb·BLOCK] (invariant_attention)."""
    B, H, q, d = query.shape
    kv, nb = k.shape[1], k.shape[2]
    g = H // kv    # query heads per key/value head, in repeat_kv's order (head = j·g + i)
    # [B, 1, nb, 1, q, BLOCK]: rows of a block's scores are (head in group, query)
    seen = seen.reshape(B, q, nb, BLOCK).permute(0, 2, 1, 3)[:, None, :, None]
    qf = query.float().reshape(B, kv, 1, g * q, d)
    s = torch.matmul(qf, k.transpose(-1, -2)) * scale
    s = torch.where(seen, s.view(B, kv, nb, g, q, BLOCK), _MIN)
    w = (s - s.amax(dim=(2, 5), keepdim=True)).exp_().view(B, kv, nb, g * q, BLOCK)
    parts = torch.matmul(w, v1)                                   # [B, kv, nb, g·q, d + 1]
    total = parts.cumsum(dim=2)[:, :, -1]
    return (total[..., :d] / total[..., d:]).to(query.dtype).view(B, H, q, d)


AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
AttentionMaskInterface.register(INVARIANT_ATTENTION, eager_mask)


def use(model: torch.nn.Module) -> None:
    """The invariant kernels for `model` and every copy made of it (the engine's, the
    shadow's): its attention, and every CPU product in this process run invariantly
    (parity/cpu_bf16.py)."""
    model.set_attn_implementation(INVARIANT_ATTENTION)
    cpu_bf16.pad_rows(TILE)


def engine_attention_of(model: torch.nn.Module) -> str:
    """The attention an engine-precision copy of `model` decodes with: the invariant one where
    the model was made invariant (`use`), else parity's engine attention."""
    own = getattr(model.config, "_attn_implementation", None)
    return INVARIANT_ATTENTION if own == INVARIANT_ATTENTION else ENGINE_ATTENTION


@contextlib.contextmanager
def engine_precision(model: torch.nn.Module, dtype: torch.dtype,
                     keep: Callable[[torch.nn.Module], bool] = lambda m: False) -> Iterator[None]:
    """Within the block every floating parameter of `model` reads as its cast to `dtype` (one
    cast per tensor, shared where weights are tied), so the model's forward is its
    low-precision copy's, and the gradient flows through the casts to the fp32 parameters.
    Buffers stay as they are, as the engine's copy keeps RoPE's tables, and so do the
    parameters of a module that `keep` names (an fp32 head, which the engine's copy keeps in
    fp32: parity/models/precision.py)."""
    casts: dict[int, torch.Tensor] = {}
    swapped: list[tuple[torch.nn.Module, str]] = []
    # An instance attribute is found before nn.Module's lookup of its parameters, so the cast
    # shadows the parameter for the block; `parameters()` and the optimizer still see fp32.
    try:
        for m in model.modules():
            if keep(m):
                continue
            for n, p in m._parameters.items():
                if p is not None and p.is_floating_point():
                    if id(p) not in casts:
                        casts[id(p)] = p.to(dtype)
                    m.__dict__[n] = casts[id(p)]
                    swapped.append((m, n))
        yield
    finally:
        for m, n in swapped:
            m.__dict__.pop(n, None)
