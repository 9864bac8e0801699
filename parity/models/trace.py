"""Where two forwards of the same tokens part: a transformers model's tensors at every op of every
decoder layer, for `parity audit --locate` (parity/audit/locate.py).

A trace is one sequence's forward as a dict from point name to a float32 copy, [tokens, features]
(`logits`: [tokens, vocabulary]). The points, in the order the forward reaches them, are spelled
here once (`LAYER_POINTS`, `MODEL_POINTS`): every engine's trace uses these names (vLLM's:
parity/engines/vllm_trace.py), so a point is compared with the same point of the trainer's model.
A model has the points its modules allow: q_norm and k_norm only where the attention normalises
its heads (Qwen3), RoPE only where the attention rotates (not GPT-2), gate only in a gated MLP,
router only in a mixture of experts (its logits; `mlp` is then the MoE block's output). A
model whose layers do not name their ops as Llama's or GPT-2's do is traced at `embed`, each
layer's `output`, `final_norm` and `logits`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch

# Each point of a decoder layer, in forward order: its name, the kind of op a finding names (and
# whose advice it prints: parity/audit/locate.py), and how a finding says it.
LAYER_POINTS = (
    ("input_norm", "norm", "input norm"),
    ("q", "matmul", "q projection"),
    ("k", "matmul", "k projection"),
    ("v", "matmul", "v projection"),
    ("q_norm", "norm", "q_norm"),
    ("k_norm", "norm", "k_norm"),
    ("q_rope", "RoPE", "q after RoPE"),
    ("k_rope", "RoPE", "k after RoPE"),
    ("attn_kernel", "attention kernel", "attention kernel (its output, before o_proj)"),
    ("attention", "matmul", "o_proj (attention's output)"),
    ("attention_add", "residual add", "residual add after attention"),
    ("post_norm", "norm", "post-attention norm"),
    ("router", "router", "router"),
    ("gate", "matmul", "gate projection"),
    ("up", "matmul", "up projection"),
    ("act", "activation", "activation product (down_proj's input)"),
    ("mlp", "matmul", "down_proj (the MLP's output)"),
    ("output", "residual add", "residual add after the MLP"))
MODEL_POINTS = {"embed": ("embedding", "the embedding"), "final_norm": ("norm", "the final norm"),
                "logits": ("head", "the logits")}
_LAYER = {name: (kind, said) for name, kind, said in LAYER_POINTS}

# Where a transformers layer holds each point: (point, attribute paths from the layer, Llama's
# and Qwen's first, GPT-2's second; "out" the module's output, "in" its input). GPT-2's fused
# c_attn is split into q, k and v by `_split3`.
_HF_POINTS = (("input_norm", ("input_layernorm", "ln_1"), "out"),
              ("q", ("self_attn.q_proj",), "out"), ("k", ("self_attn.k_proj",), "out"),
              ("v", ("self_attn.v_proj",), "out"),
              ("q_norm", ("self_attn.q_norm",), "out"), ("k_norm", ("self_attn.k_norm",), "out"),
              ("attn_kernel", ("self_attn.o_proj", "attn.c_proj"), "in"),
              ("attention", ("self_attn", "attn"), "out"),
              ("attention_add", ("post_attention_layernorm", "ln_2"), "in"),
              ("post_norm", ("post_attention_layernorm", "ln_2"), "out"),
              ("router", ("mlp.gate",), "out"),   # a MoE block's router: its logits first
              ("gate", ("mlp.gate_proj",), "out"), ("up", ("mlp.up_proj", "mlp.c_fc"), "out"),
              ("act", ("mlp.down_proj", "mlp.c_proj"), "in"),
              ("mlp", ("mlp",), "out"))


def point_names(layers: int) -> list[str]:
    """Every point a model with `layers` decoder layers can have, in forward order."""
    return (["embed"] + [f"layers.{i}.{p}" for i in range(layers) for p, _, _ in LAYER_POINTS]
            + ["final_norm", "logits"])


def in_order(points: Any, layers: int) -> list[str]:
    """The points of `points` (a trace's keys) in forward order."""
    have = set(points)
    return [p for p in point_names(layers) if p in have]


def kind(point: str) -> str:
    """What a finding calls the op behind `point`: norm, matmul, RoPE, attention kernel, ..."""
    return _entry(point)[0]


def describe(point: str) -> str:
    """`layers.3.k_norm` → "layer 3's k_norm"."""
    layer = layer_of(point)
    said = _entry(point)[1]
    return said if layer is None else f"layer {layer}'s {said}"


def _entry(point: str) -> tuple[str, str]:
    return MODEL_POINTS.get(point) or _LAYER[point.rsplit(".", 1)[-1]]


def layer_of(point: str) -> int | None:
    """The decoder layer a point belongs to, None for embed, final_norm and logits."""
    return int(point.split(".")[1]) if point.startswith("layers.") else None


def keep(x: Any, rows: int | None = None) -> torch.Tensor:
    """A float32 copy of an op's output (the first element of a tuple), [rows, features] (token
    major, as every point is; `rows` None: the last dimension kept). A copy always: some engines
    update their tensors in place after the op returns."""
    t = x[0] if isinstance(x, (tuple, list)) else x
    t = t.detach().to(torch.float32, copy=True)
    return t.reshape(-1, t.shape[-1]) if rows is None else t.reshape(rows, -1)


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


def _find(root: torch.nn.Module, paths: tuple[str, ...]) -> torch.nn.Module | None:
    for path in paths:
        mod: Any = root
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


@contextlib.contextmanager
def hooked(model: torch.nn.Module, rows: int) -> Iterator[dict[str, torch.Tensor]]:
    """Hooks on a transformers model's ops for as long as the block runs; the dict fills with
    each point's copy at the next forward (one sequence of `rows` tokens, batch 1)."""
    inner, layers = decoder(model)
    out: dict[str, torch.Tensor] = {}
    handles = []

    def put(name: str, where: str) -> Any:
        if where == "in":
            def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                out[name] = keep(args[0] if args else kwargs["hidden_states"], rows)
            return pre
        return lambda mod, args, kwargs, result: out.__setitem__(name, keep(result, rows))

    def split3(i: int) -> Callable:
        def f(mod: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
            for p, part in zip("qkv", keep(result, rows).chunk(3, dim=-1)):
                out[f"layers.{i}.{p}"] = part
        return f

    handles.append(layers[0].register_forward_pre_hook(put("embed", "in"), with_kwargs=True))
    for i, layer in enumerate(layers):
        for point, paths, where in _HF_POINTS:
            mod = _find(layer, paths)
            if mod is not None:
                register = (mod.register_forward_pre_hook if where == "in"
                            else mod.register_forward_hook)
                handles.append(register(put(f"layers.{i}.{point}", where), with_kwargs=True))
        fused = _find(layer, ("attn.c_attn",))
        if fused is not None:
            handles.append(fused.register_forward_hook(split3(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(put(f"layers.{i}.output", "out"),
                                                   with_kwargs=True))
    norm = getattr(inner, "norm", None) or getattr(inner, "ln_f", None)
    if norm is not None:
        handles.append(norm.register_forward_hook(put("final_norm", "out"), with_kwargs=True))
    try:
        with _rope_traced(layers, out, rows, handles):
            yield out
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _rope_traced(layers: Any, out: dict[str, torch.Tensor], rows: int, handles: list
                 ) -> Iterator[None]:
    """q and k after RoPE. transformers rotates with a function of the attention's module
    (`apply_rotary_pos_emb`), not a module, so that function is wrapped while the block runs;
    which layer calls it is set by a pre-hook on each attention. Its outputs are [1, heads,
    tokens, head_dim]: made token major, as the other points are."""
    attn = [_find(layer, ("self_attn",)) for layer in layers]
    home = sys.modules[type(attn[0]).__module__] if attn and attn[0] is not None else None
    rope = getattr(home, "apply_rotary_pos_emb", None)
    if rope is None:
        yield
        return
    at: list[int] = [0]
    for i, a in enumerate(attn):
        handles.append(a.register_forward_pre_hook(lambda m, args, i=i: at.__setitem__(0, i)))

    def traced(q: torch.Tensor, k: torch.Tensor, *a: Any, **kw: Any) -> Any:
        q, k = rope(q, k, *a, **kw)
        for p, x in (("q_rope", q), ("k_rope", k)):
            out[f"layers.{at[0]}.{p}"] = keep(x.transpose(1, 2), rows)
        return q, k

    home.apply_rotary_pos_emb = traced
    try:
        yield
    finally:
        home.apply_rotary_pos_emb = rope


@torch.no_grad()
def trace(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """One sequence through `model` (batch 1, no padding, the whole sequence at once) under
    whatever autocast or kernels the caller set: every point's float32 copy."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with hooked(model, len(ids)) as out:
        logits = model(input_ids=x, position_ids=torch.arange(len(ids), device=device)[None],
                       use_cache=False).logits
    out["logits"] = keep(logits, len(ids))
    return out
