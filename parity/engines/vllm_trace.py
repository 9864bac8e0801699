"""vLLM's forward traced op by op, for `parity audit --locate`: hooks on the modules of the model
vLLM runs in this process, under the point names of parity/models/trace.py.

vLLM's decoder layers (Llama, Qwen2, Qwen3, Mistral) pass the residual stream beside the hidden
state and add it inside the next norm (`input_layernorm(x, residual)` returns the normed sum and
the sum): the stream after layer i is what layer i+1's input norm, or the final norm, returns as
its second output, and the stream after attention's add is what the post-attention norm returns
second. That sum is what vLLM keeps (in its dtype), so it is what is compared. Its attention
projects q, k and v in one matmul (`qkv_proj`, split here at the attention's q_size and
kv_size), rotates them in one module shared by every layer (`rotary_emb`, which returns q and
k), and its MLP projects
gate and up in one (`gate_up_proj`, gate first, as `SiluAndMul` reads it); a mixture of
experts' block scores its experts with `gate` (the router's logits). The logits are vLLM's
own head, read from `compute_logits`. Every forward is recorded apart (`forwards`): a prefill of
the whole sequence, or the decode step after it. vLLM runs both eagerly on the CPU and wherever
parity's traces run it (CUDA graphs replay decode steps only where asked for).
Private vLLM interfaces: `tests/test_vllm_real.py` holds them to the trainer's own trace.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.models.trace import keep

# The architectures whose vLLM layers the hooks know (checked before an audit samples).
TRACED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
          "Qwen3MoeForCausalLM")
_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class Tracer:
    """Hooks on one vLLM model in the worker; while `on`, each forward appends its points and
    its logits' rows to `forwards`."""

    def __init__(self, model: Any):
        inner = model.model
        self.forwards: list[tuple[dict[str, torch.Tensor], list[torch.Tensor]]] = []
        self.on = False
        self.rows = 0    # the tokens of the forward running
        self.layer = 0   # the layer running
        layers = inner.layers
        last = len(layers) - 1
        self.handles = [layers[0].register_forward_pre_hook(self._embed, with_kwargs=True),
                        inner.norm.register_forward_hook(self._hook(
                            lambda pts, out: self._stream(pts, out, "final_norm",
                                                          f"layers.{last}.output")),
                            with_kwargs=True)]
        # vLLM builds one rotary module for all layers (`get_rope` caches it): its hook names
        # the layer running, which a pre-hook on each layer sets.
        self.handles += [layer.register_forward_pre_hook(
            lambda m, args, i=i: setattr(self, "layer", i)) for i, layer in enumerate(layers)]
        ropes = {id(r): r for r in (getattr(x.self_attn, "rotary_emb", None) for x in layers)
                 if r is not None}
        self.handles += [r.register_forward_hook(self._hook(self._rope), with_kwargs=True)
                         for r in ropes.values()]
        # per layer, so that a test can take one layer's away
        self.layer_handles = {i: [m.register_forward_hook(self._hook(f), with_kwargs=True)
                                  for m, f in self._layer_hooks(i, layer)]
                              for i, layer in enumerate(layers)}
        compute = model.compute_logits

        def compute_logits(hidden: torch.Tensor, *a: Any, **kw: Any) -> Any:
            out = compute(hidden, *a, **kw)
            if self.on and out is not None and self.forwards:
                self.forwards[-1][1].append(keep(out))
            return out

        model.compute_logits = compute_logits
        self._restore = lambda: setattr(model, "compute_logits", compute)

    def _layer_hooks(self, i: int, layer: Any) -> list[tuple[Any, Any]]:
        """(module, what its output gives) for layer i's modules that exist."""
        attn, mlp = layer.self_attn, layer.mlp
        name = lambda p: f"layers.{i}.{p}"   # noqa: E731
        put = lambda p: lambda pts, out: pts.__setitem__(name(p), keep(out, self.rows))  # noqa
        on = [(layer.input_layernorm, lambda pts, out: self._input_norm(pts, out, i)),
              (attn, put("attention")),
              (layer.post_attention_layernorm,
               lambda pts, out: self._stream(pts, out, name("post_norm"), name("attention_add"))),
              (mlp, put("mlp"))]
        sub = {"qkv_proj": self._parts((name("q"), name("k"), name("v")),
                                       lambda: [attn.q_size, attn.kv_size, attn.kv_size]),
               "q_norm": put("q_norm"), "k_norm": put("k_norm"), "attn": put("attn_kernel")}
        # a mixture of experts' block (Qwen3-MoE) holds its router as `gate`, its logits
        # the `router` point; `mlp` is then the block's output
        mlp_sub = {"gate_up_proj": self._parts((name("gate"), name("up")), lambda: None),
                   "act_fn": put("act"), "gate": put("router")}
        return on + [(getattr(attn, n), f) for n, f in sub.items() if hasattr(attn, n)] \
            + [(getattr(mlp, n), f) for n, f in mlp_sub.items() if hasattr(mlp, n)]

    def _hook(self, fn: Any) -> Any:
        def run(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
            if self.on and self.forwards:
                fn(self.forwards[-1][0], out)
        return run

    def _embed(self, mod: Any, args: tuple, kwargs: dict) -> None:
        if self.on:   # a forward starts
            x = args[1] if len(args) > 1 else kwargs["hidden_states"]
            self.rows = x.shape[0]
            self.forwards.append(({"embed": keep(x, self.rows)}, []))

    def _parts(self, names: tuple[str, ...], sizes: Any) -> Any:
        """A fused projection's output split into its parts (halves where `sizes()` is None)."""
        def f(pts: dict, out: Any) -> None:
            x = keep(out, self.rows)
            for name, part in zip(names, x.split(sizes() or x.shape[-1] // 2, dim=-1)):
                pts[name] = part
        return f

    def _stream(self, pts: dict, out: Any, normed: str, stream: str) -> None:
        """A norm fused with the residual add: (normed, the stream it added)."""
        pts[normed] = keep(out, self.rows)
        pts[stream] = keep(out[1], self.rows)

    def _input_norm(self, pts: dict, out: Any, i: int) -> None:
        if isinstance(out, tuple):   # (normed, the stream after layer i − 1)
            pts[f"layers.{i - 1}.output"] = keep(out[1], self.rows)
        pts[f"layers.{i}.input_norm"] = keep(out, self.rows)

    def _rope(self, pts: dict, out: Any) -> None:
        pts[f"layers.{self.layer}.q_rope"] = keep(out[0], self.rows)
        pts[f"layers.{self.layer}.k_rope"] = keep(out[1], self.rows)

    def close(self) -> None:
        for h in self.handles + [h for hs in self.layer_handles.values() for h in hs]:
            h.remove()
        self._restore()


def install(worker: Any) -> Tracer | None:
    """Runs on vLLM's worker (collective_rpc): a Tracer on its model, or None where the model's
    layers are not of the Llama family's shape."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    model = getattr(runner, "model", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layers[0], n) for n in _LAYER) or \
            not hasattr(model, "compute_logits"):
        return None
    return Tracer(model)


def traced_logits(calls: list[torch.Tensor], tokens: int) -> torch.Tensor | None:
    """The [tokens, V] logits from `compute_logits`' calls in one prefill: the sampled (last)
    position's row comes first, then the prompt log-probs' rows for positions 0 .. tokens − 2."""
    if not calls or calls[0].shape[0] != 1:
        return None
    rest = torch.cat(calls[1:]) if len(calls) > 1 else calls[0][:0]
    if rest.shape[0] != tokens - 1:
        return None
    return torch.cat([rest, calls[0]])
