"""Precision as a first-class setting: dtypes, trainer autocast, loss scaling, weight casts.

The trainer always keeps fp32 master weights; `trainer_dtype` only decides the compute precision
(autocast). The engine holds its own copy cast to `engine_dtype`. These two facts are what make
β = ℓ_π − ℓ_s a pure precision gap.
"""

from __future__ import annotations

import contextlib
import math
import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def autocast(trainer_dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Trainer compute precision. fp32 runs without autocast, so it is the true fp32 forward."""
    if trainer_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=TORCH_DTYPES[trainer_dtype])


class LossScaler:
    """One optimizer step with overflow protection, whatever the precision.

    fp16 uses torch.amp.GradScaler (dynamic loss scaling: fp16 gradients underflow without it).
    Other dtypes use a scale of 1 but get the same guard: a step whose gradient is not finite is
    skipped, counted, and never applied.
    """

    def __init__(self, trainer_dtype: str, device: torch.device, init_scale: float = 2.0**16,
                 growth_interval: int = 400):
        self.enabled = trainer_dtype == "fp16"
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           growth_interval=growth_interval, enabled=self.enabled)
        self.skipped = 0

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
             max_grad_norm: float) -> tuple[bool, float]:
        """Unscale, clip, step. Returns (applied, grad_norm before clipping)."""
        self.scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0
        finite = math.isfinite(norm)
        if self.enabled:
            # GradScaler skips optimizer.step itself when it found inf/nan while unscaling.
            self.scaler.step(optimizer)
            self.scaler.update()
        elif finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not finite:
            self.skipped += 1
        return finite, norm

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped = int(state.get("skipped", 0))


@torch.no_grad()
def cast_weights_into(master: torch.nn.Module, target: torch.nn.Module) -> float:
    """Copy fp32 master weights into `target` in its own dtype; return the fraction of target
    values that changed (`sync/changed_frac`). Small updates can leave a bf16 cast unchanged."""
    src = dict(master.state_dict())
    changed = total = 0
    for name, t in target.state_dict().items():
        new = src[name].to(t.dtype)
        if t.is_floating_point():
            changed += int((new != t).sum())
            total += t.numel()
        t.copy_(new)
    return changed / max(total, 1)

