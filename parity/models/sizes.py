"""What a model's tensors take in memory, from its config alone: no torch, no weights loaded.

The engines size vLLM's KV cache with it and the run's memory estimate (parity/runs/memory.py)
prices weights and activations with its byte table, so both count a dtype the same way.
"""

from __future__ import annotations

import math
from typing import Any

# Bytes an element takes in each of parity's dtype settings.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def kv_cache_bytes(config: Any, dtype: str, rows: int, max_len: int) -> int:
    """The KV cache every row of a vLLM batch needs at its full length at once, with room for
    vLLM's block rounding. Asked for explicitly: vLLM's CPU backend would otherwise reserve a
    share of the machine's whole memory (and refuse to start when that much is not free)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * DTYPE_BYTES[dtype]
    blocks = math.ceil(max_len / 16) + 1
    return int(rows * blocks * 16 * per_token * 1.25) + (16 << 20)
