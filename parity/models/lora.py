"""LoRA: fp32 adapters trained on a frozen base, and how the engine and the shadow see them.

The trainer holds a peft model: the base's weights frozen, in fp32 or in bf16 (`base_dtype`),
and on each targeted linear layer the adapters A (r × in) and B (out × r) in fp32, so that the
layer computes W x + (α/r) B A x. The engine serves W' = W + (α/r) B A in engine precision, in
one of two ways (`lora_merge`):

    merged     W' summed in fp32 from the base and the adapters, then cast once to the engine's
               dtype: one weight per layer, as TRL merges adapters before loading vLLM's weights
    unmerged   the base and the adapters each cast to the engine's dtype and applied as their
               own products, W x + (α/r) B (A x), as vLLM serves a LoRA request

The two differ by rounding only; docs/lora.md measures how much. The shadow uses the engine's
choice, so the shadow ratio sees the engine's arithmetic. An engine's copy remembers the
adapters it was last cast from: a checkpoint keeps those (a few MB) instead of the engine's whole
weights, and a resumed run rebuilds the engine from them.
"""

from __future__ import annotations

# Imports inside functions: peft loads when a run uses LoRA (start-up time: about a second).
import copy
import warnings
from pathlib import Path
from typing import Any

import torch

from parity.errors import ParityError, one_line
from parity.files import check_safetensors

ADAPTER = "default"
# peft's name for every linear layer but the output head: the attention and MLP projections.
ALL_LINEAR = "all-linear"


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _linear_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) of a layer LoRA can adapt: a Linear, or GPT-2's Conv1D (its weight in x out)."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return tuple(module.weight.shape)  # type: ignore[return-value]
    return None


def planned_adapters(model: torch.nn.Module, rank: int, targets: str) -> int:
    """The adapter parameters `wrap` would add, counted before any is allocated (a rank typed
    with extra zeros must be refused, not allocated). A target name that matches no layer is
    refused even beside names that do: peft would adapt the others and drop it silently."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = {name: shape for name, m in model.named_modules()
              if (shape := _linear_shape(m)) is not None and m is not head}
    if targets == ALL_LINEAR:
        chosen = list(layers)
    else:
        names = [t.strip() for t in targets.split(",")]
        matches = {t: [k for k in layers if k == t or k.endswith("." + t)] for t in names}
        unknown = [t for t, found in matches.items() if not found]
        if unknown:
            known = sorted({k.rsplit(".", 1)[-1] for k in layers})
            raise ParityError(f"lora_targets={targets!r}: {', '.join(map(repr, unknown))} names "
                              f"no linear layer of the model; its layers are "
                              f"{', '.join(known)} (or all-linear)")
        chosen = sorted({k for found in matches.values() for k in found})
    return sum(rank * (layers[k][0] + layers[k][1]) for k in chosen)


def wrap(model: torch.nn.Module, rank: int, alpha: float | None, targets: str, merge: bool,
         base_dtype: torch.dtype) -> torch.nn.Module:
    """`model` with fresh LoRA adapters (B = 0: the adapted model starts as the base), its base
    frozen in `base_dtype`."""
    from peft import LoraConfig, get_peft_model
    model.to(base_dtype)
    names = ALL_LINEAR if targets == ALL_LINEAR else [t.strip() for t in targets.split(",")]
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=names, lora_dropout=0.0, bias="none")
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5 a deprecated name (is_gradient_checkpointing) on every
            # wrap; the warning is theirs to fix and says nothing about this run.
            warnings.simplefilter("ignore", FutureWarning)
            # peft's own pattern for a mixture of experts' fused weights, unmatched where the
            # model names them otherwise: nothing about this run
            warnings.filterwarnings("ignore", "The following alpha_pattern keys", RuntimeWarning)
            # autocast_adapter_dtype: the adapters in fp32 whatever the base's dtype
            peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as e:
        raise ParityError(f"lora_targets={targets!r}: {e}") from None
    peft_model.parity_merge = merge
    return peft_model


def from_adapter(model: torch.nn.Module, adapter_dir: str, merge: bool) -> torch.nn.Module:
    """`model` with the adapters saved in `adapter_dir` (peft's save_pretrained), frozen."""
    from peft import PeftModel
    from safetensors import SafetensorError
    for f in Path(adapter_dir).glob("*.safetensors"):
        check_safetensors(f, "adapter file")
    try:
        with warnings.catch_warnings():  # as in `wrap`
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = PeftModel.from_pretrained(model, adapter_dir, adapter_name=ADAPTER)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ParityError(f"adapter {adapter_dir}: cannot load it onto the model "
                          f"({one_line(e)})") from None
    peft_model.parity_merge = merge
    return peft_model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights (peft's names), detached copies."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ParityError(f"the saved adapters do not fit the run's model (unexpected "
                          f"{unexpected[:3]})")


def merged_state(master: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state, names without peft's, each adapted layer's weight summed with
    its adapters in fp32."""
    from peft.tuners.lora import LoraLayer
    base = master.get_base_model()
    src = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items()
           if "lora_" not in k}
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            # a Linear's weight, or the parameter peft adapts in place (a mixture of experts'
            # [experts, out, in] weights and its router: peft's ParamWrapper, nested per
            # parameter)
            param = getattr(mod, "parameter_name", None) or "weight"
            w = getattr(mod.get_base_layer(), param)
            key = f"{name.replace('.base_layer', '')}.{param}"
            src[key] = w.float() + mod.get_delta_weight(ADAPTER).float()
    return src


def engine_copy(master: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The engine's (or the shadow's) copy of a LoRA master in `dtype`, merged or not as the
    master says, eval mode, without gradients."""
    if getattr(master, "parity_merge", True):
        plain = copy.deepcopy(master).merge_and_unload()
        plain.to(dtype)
        cast_into(master, plain, count=False)
    else:
        plain = copy.deepcopy(master).to(dtype)
    plain.eval().requires_grad_(False)
    plain.parity_synced = adapter_state(master)
    return plain


@torch.no_grad()
def cast_into(master: torch.nn.Module, target: torch.nn.Module, count: bool = True) -> float:
    """What `precision.cast_weights_into` does for a LoRA master: `target`'s weights become the
    master's adapted weights in `target`'s dtypes; returns the share of values that changed."""
    merged = not is_lora(target)
    src = merged_state(master) if merged else master.state_dict()
    changed = total = 0
    for name, t in target.state_dict().items():
        if name not in src:
            raise ParityError(f"the engine's copy has {name}, which the LoRA model lacks")
        new = src[name].to(t.dtype)
        if count and t.is_floating_point():
            changed += (new != t).sum()
            total += t.numel()
        t.copy_(new)
    target.parity_synced = adapter_state(master)
    return int(changed) / max(total, 1)


def restore_engine(master: torch.nn.Module, engine_model: torch.nn.Module,
                   synced: dict[str, torch.Tensor]) -> None:
    """The engine as it was after casting the adapters `synced`, rebuilt on the master: the
    master takes them for the cast and gets its own back after."""
    own = adapter_state(master)
    load_adapter_state(master, synced)
    cast_into(master, engine_model, count=False)
    load_adapter_state(master, own)
