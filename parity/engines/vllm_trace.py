"""vLLM's forward traced op by op, for `parity audit --locate`: hooks on the modules of the model
vLLM runs in this process, under the point names of parity/models/trace.py.

vLLM's decoder layers (Llama, Qwen2, Qwen3, Mistral) pass the residual stream beside the hidden
state and add it inside the next norm (`input_layernorm(x, residual)` returns the normed sum and
the sum): the stream after layer i is what layer i+1's input norm, or the final norm, returns as
its second output, and the stream after attention's add is what the post-attention norm returns
second. That sum is what vLLM keeps (in its dtype), so it is what is compared. The logits are
vLLM's own head, read from `compute_logits`: the sampled position's row, and with
`prompt_logprobs` every other position's. The traced forward is a prefill of the whole
sequence, which vLLM runs eagerly even where it replays CUDA graphs (those are decode-only).
Private vLLM interfaces: `tests/test_vllm_real.py` holds them to the trainer's own trace.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.models.trace import keep


class Tracer:
    """Hooks on one vLLM model in the worker; `points` fills at each forward while `on`."""

    def __init__(self, model: Any):
        inner = model.model
        self.points: dict[str, torch.Tensor] = {}
        self.logits: list[torch.Tensor] = []
        self.on = False
        layers = inner.layers
        last = len(layers) - 1

        def hook(fn: Any) -> Any:
            def run(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
                if self.on:
                    fn(args, kwargs, out)
            return run

        def put(name: str) -> Any:
            return hook(lambda a, k, out: self.points.__setitem__(name, keep(out)))

        def input_norm(i: int) -> Any:
            def f(a: tuple, k: dict, out: Any) -> None:
                if isinstance(out, tuple):   # (normed, the stream after layer i − 1)
                    self.points[f"layers.{i - 1}.output"] = keep(out[1])
                self.points[f"layers.{i}.input_norm"] = keep(out)
            return hook(f)

        def post_norm(i: int) -> Any:
            def f(a: tuple, k: dict, out: Any) -> None:
                self.points[f"layers.{i}.post_norm"] = keep(out)
                self.points[f"layers.{i}.attention_add"] = keep(out[1])
            return hook(f)

        def final(a: tuple, k: dict, out: Any) -> None:
            self.points["final_norm"] = keep(out)
            self.points[f"layers.{last}.output"] = keep(out[1])

        def embed(mod: Any, args: tuple, kwargs: dict) -> None:
            if self.on:
                x = args[1] if len(args) > 1 else kwargs["hidden_states"]
                self.points["embed"] = keep(x)

        self.handles = [layers[0].register_forward_pre_hook(embed, with_kwargs=True),
                        inner.norm.register_forward_hook(hook(final), with_kwargs=True)]
        for i, layer in enumerate(layers):
            self.handles += [
                layer.input_layernorm.register_forward_hook(input_norm(i), with_kwargs=True),
                layer.self_attn.register_forward_hook(put(f"layers.{i}.attention"),
                                                      with_kwargs=True),
                layer.post_attention_layernorm.register_forward_hook(post_norm(i),
                                                                     with_kwargs=True),
                layer.mlp.register_forward_hook(put(f"layers.{i}.mlp"), with_kwargs=True)]
        compute = model.compute_logits

        def compute_logits(hidden: torch.Tensor, *a: Any, **kw: Any) -> Any:
            out = compute(hidden, *a, **kw)
            if self.on and out is not None:
                self.logits.append(keep(out))
            return out

        model.compute_logits = compute_logits
        self._restore = lambda: setattr(model, "compute_logits", compute)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self._restore()


def install(worker: Any) -> Tracer | None:
    """Runs on vLLM's worker (collective_rpc): a Tracer on its model, or None where the model's
    layers are not of the Llama family's shape."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    model = getattr(runner, "model", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    if layers is None or not all(hasattr(layers[0], n) for n in names) or \
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
