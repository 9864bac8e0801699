"""parity's attention: eager attention's arithmetic without its costs at length, registered with
transformers under ENGINE_ATTENTION. The hf engine decodes with it and the shadow forward
attends the same way (parity/diagnostics.py), so the two share kernels."""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask


def engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     parity_kv_len: int | None = None, parity_scratch: dict | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention's arithmetic (QKᵀ and the product with V in the model's dtype, the
    softmax in fp32, as transformers' eager path for Llama-family models), without what made
    decoding slow down with length: the static cache is read only up to `parity_kv_len`, the
    positions filled so far, instead of all of it at every token; and grouped-query heads share
    their key/value head through a reshape of the query instead of eager's `repeat_kv`, which
    copied every cached key and value once per query head per layer per token (figures:
    docs/performance.md). Without `parity_kv_len` (the shadow's full forward) it attends to
    every key it is given. `parity_scratch` (a dict the decode loop owns) holds one buffer that
    every layer's key copy reuses."""
    if parity_kv_len is not None:
        # The filled part of the static cache is a view strided over its whole length, on
        # which CPU's batched QKᵀ takes a slow path; a contiguous copy of the keys costs less
        # and gives the same products, bit for bit: decoding runs 1.5-1.9× faster at 256-1,024
        # tokens. The copy goes into one reused buffer: a fresh tensor of that size each layer
        # and token is a fresh allocation the OS must zero, which made the copy 5× slower than
        # the products at 4,096 tokens (docs/performance.md).
        filled = key[:, :, :parity_kv_len]
        buf = None if parity_scratch is None else parity_scratch.get("keys")
        if parity_scratch is not None and (buf is None or buf.dtype != key.dtype
                                           or buf.numel() < filled.numel()):
            buf = parity_scratch["keys"] = torch.empty(key.numel(), dtype=key.dtype,
                                                       device=key.device)
        key = (filled.contiguous() if buf is None
               else buf[:filled.numel()].view(filled.shape).copy_(filled))
        value = value[:, :, :parity_kv_len]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :parity_kv_len]
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        # Capped logits or attention sinks (Gemma 2, gpt-oss): the model's own eager path.
        own = sys.modules[type(module).__module__].eager_attention_forward
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                   **kwargs)
    B, H, q, d = query.shape
    kv, L = key.shape[1], key.shape[2]
    g = H // kv    # query heads per key/value head, in repeat_kv's order (head = j·g + i)
    w = torch.matmul(query.reshape(B, kv, g * q, d), key.transpose(2, 3))
    w = w * (d ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        w = (w.view(B, kv, g, q, L) + attention_mask[:, :, None]).view(B, kv, g * q, L)
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and module.training:
        w = torch.nn.functional.dropout(w, p=dropout)
    out = torch.matmul(w, value).view(B, H, q, d)
    return out.transpose(1, 2).contiguous(), None


# A decode step attends one query to a short cache, where torch's CPU SDPA kernel costs more
# in setup than the products do; `engine_attention` is eager's arithmetic without its costs at
# length. The shadow forward attends the same way, because a different attention kernel would
# put a kernel gap inside α. Figures: docs/performance.md.
ENGINE_ATTENTION = "parity_eager"
AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
AttentionMaskInterface.register(ENGINE_ATTENTION, eager_mask)  # the additive mask eager uses
