"""Where two forwards of the same tokens part: a transformers model's hidden state at every op of
every decoder layer, for `parity audit --locate` (parity/audit/locate.py).

A trace is one sequence's forward as a dict from point name to a float32 copy, [tokens, width]
(`logits`: [tokens, vocabulary]). The points, in the order the forward reaches them:

    embed                        the input of the first decoder layer
    layers.{i}.input_norm        the norm before attention
    layers.{i}.attention         attention's output projection
    layers.{i}.attention_add     the residual stream after attention's add
    layers.{i}.post_norm         the norm before the MLP
    layers.{i}.mlp               the MLP's output
    layers.{i}.output            the residual stream after the layer (the MLP's add)
    final_norm, logits

Any engine's trace uses these names (vLLM's: parity/engines/vllm_trace.py), so a point is
compared with the same point of the trainer's model. A model whose layers do not name their ops
as Llama's or GPT-2's do is traced at `embed`, each layer's `output`, `final_norm` and `logits`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

# Each op of a decoder layer: the point its output is, the attribute names that hold it (the
# Llama/Qwen family's, GPT-2's), and what kind of op a finding names.
LAYER_OPS = (("input_norm", ("input_layernorm", "ln_1"), "norm"),
             ("attention", ("self_attn", "attn"), "attention"),
             ("post_norm", ("post_attention_layernorm", "ln_2"), "norm"),
             ("mlp", ("mlp",), "MLP"))
# Points that are not an op's output: the residual adds, which no module computes.
KIND = {"embed": "embedding", "attention_add": "residual add", "output": "residual add",
        "final_norm": "norm", "logits": "head", **{p: kind for p, _, kind in LAYER_OPS}}
LAYER_POINTS = ("input_norm", "attention", "attention_add", "post_norm", "mlp", "output")


def point_names(layers: int) -> list[str]:
    """Every point of a model with `layers` decoder layers, in forward order."""
    return (["embed"] + [f"layers.{i}.{p}" for i in range(layers) for p in LAYER_POINTS]
            + ["final_norm", "logits"])


def kind(point: str) -> str:
    """What a finding calls the op behind `point`: norm, attention, MLP, residual add, head."""
    return KIND[point.rsplit(".", 1)[-1]]


def layer_of(point: str) -> int | None:
    """The decoder layer a point belongs to, None for embed, final_norm and logits."""
    return int(point.split(".")[1]) if point.startswith("layers.") else None


def keep(x: Any) -> torch.Tensor:
    """A float32 copy of an op's output (the first element of a tuple), [tokens, width]. A copy
    always: some engines update their tensors in place after the op returns."""
    t = x[0] if isinstance(x, (tuple, list)) else x
    return t.detach().to(torch.float32, copy=True).reshape(-1, t.shape[-1])


def decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """(the module holding the decoder layers and final norm, its list of layers)."""
    base = getattr(model, "get_base_model", lambda: model)()   # a peft model
    inner = base.get_decoder() if hasattr(base, "get_decoder") else base
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(inner, "h", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__}: no decoder layers found to trace")
    return inner, layers


def layer_count(model: torch.nn.Module) -> int:
    return len(decoder(model)[1])


@contextlib.contextmanager
def hooked(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Forward hooks on a transformers model's ops for as long as the block runs; the dict fills
    with each point's copy at the next forward (one sequence, batch 1)."""
    inner, layers = decoder(model)
    out: dict[str, torch.Tensor] = {}
    handles = []

    def put(name: str) -> Any:
        return lambda mod, args, kwargs, result: out.__setitem__(name, keep(result))

    def put_input(name: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            out[name] = keep(args[0] if args else kwargs["hidden_states"])
        return hook

    handles.append(layers[0].register_forward_pre_hook(put_input("embed"), with_kwargs=True))
    for i, layer in enumerate(layers):
        for point, attrs, _ in LAYER_OPS:
            mod = next((getattr(layer, a) for a in attrs if hasattr(layer, a)), None)
            if mod is not None:
                handles.append(mod.register_forward_hook(put(f"layers.{i}.{point}"),
                                                         with_kwargs=True))
                if point == "post_norm":   # its input is the stream after attention's add
                    handles.append(mod.register_forward_pre_hook(
                        put_input(f"layers.{i}.attention_add"), with_kwargs=True))
        handles.append(layer.register_forward_hook(put(f"layers.{i}.output"), with_kwargs=True))
    norm = getattr(inner, "norm", None) or getattr(inner, "ln_f", None)
    if norm is not None:
        handles.append(norm.register_forward_hook(put("final_norm"), with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def trace(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """One sequence through `model` (batch 1, no padding, the whole sequence at once) under
    whatever autocast or kernels the caller set: every point's float32 copy."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with hooked(model) as out:
        logits = model(input_ids=x, position_ids=torch.arange(len(ids), device=device)[None],
                       use_cache=False).logits
    out["logits"] = keep(logits)
    return out
