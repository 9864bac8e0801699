"""Precision as a first-class setting: dtypes, trainer autocast, loss scaling, weight casts.

The trainer always keeps fp32 master weights; `trainer_dtype` only decides the compute precision
(autocast). The engine holds its own copy cast to `engine_dtype`. These two facts are what make
β = ℓ_π − ℓ_s a pure precision gap.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_file, save_model
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from parity.errors import ParityError
from parity.files import check_safetensors, read_safetensors
from parity.models import lora
from parity.runs.distributed import full_tensor

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


class FP16MatmulOnCPU(TorchFunctionMode):
    """fp16 matrix products as GPU tensor cores compute them: fp16 inputs, wide accumulation,
    fp16 output. On CPU, torch's native fp16 GEMM has no fast kernel (several times slower than
    this emulation: docs/performance.md), so we compute the product of the fp16-rounded inputs in
    float64 and round the result to fp16. Covers what fp16 autocast would have lowered (linear,
    matmul, bmm, mm, attention); backward runs the same way, through the casts.

    Why float64, not the fp32 that tensor cores accumulate in: a row's result must not depend on
    how many rows are multiplied with it. The engine decodes one position at a time (B rows per
    linear, one query row per head in attention); the shadow and the trainer score the whole
    sequence at once. torch's fp32 CPU GEMM takes another kernel, so another summation order,
    for a few rows (here 1-3) than for many, and about 0.1% of the fp16-rounded outputs then
    differ by an ulp. Over 30 layers that made the fp16 kernel gap |α| of SmolLM2-135M 5e-3 per
    token against bf16's 7e-6 (whose native kernel gives a row the same result in any batch).
    A product of two fp16 numbers is exact in float64, and float64 sums K of them to within
    ~K·2⁻⁵³ of the sum of their magnitudes, ~10⁹ times inside fp16's half-ulp of 2⁻¹²: bar a
    near-tie, the fp16 result is the exact product correctly rounded whatever the summation order,
    so the same in every shape. It is within an ulp of tensor cores' fp32 accumulation, and costs
    about twice the fp32 emulation (docs/performance.md).
    """

    OPS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
           torch.bmm, F.scaled_dot_product_attention}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.OPS:
            return func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        autocast16 = (torch.is_autocast_enabled("cpu")
                      and torch.get_autocast_dtype("cpu") == torch.float16)
        if not (autocast16 or any(t.dtype == torch.float16 for t in tensors)) or \
                any(t.device.type != "cpu" for t in tensors):
            return func(*args, **kwargs)

        def to16(a):  # rounded to fp16, then widened to float64: see the class docstring
            return a.to(torch.float16).double() if isinstance(a, torch.Tensor) and \
                a.is_floating_point() else a
        # `out=` (TRL's chunked log-prob kernel writes tiles in place) must receive the result,
        # not an fp32 stand-in of itself.
        dest = kwargs.pop("out", None)
        with torch.autocast("cpu", enabled=False):
            out = func(*(to16(a) for a in args), **{k: to16(v) for k, v in kwargs.items()})
        if dest is not None:
            return dest.copy_(out)
        return out.to(torch.float16)


def fp16_kernels(dtype: str, device: torch.device, mode: str) -> contextlib.AbstractContextManager:
    """The context in which fp16 compute runs: FP16MatmulOnCPU for `mode="emulate"` on CPU."""
    if dtype == "fp16" and device.type == "cpu" and mode == "emulate":
        return FP16MatmulOnCPU()
    return contextlib.nullcontext()


def _recompute_emulated() -> tuple[contextlib.AbstractContextManager, FP16MatmulOnCPU]:
    # The checkpointed forward itself runs inside the caller's emulation already.
    return contextlib.nullcontext(), FP16MatmulOnCPU()


def checkpoint_under_emulation(model: torch.nn.Module, kwargs: dict | None) -> None:
    """Make gradient checkpointing recompute `model`'s layers under FP16MatmulOnCPU, as their
    forward ran. The backward that recomputes them starts inside the mode's own handler (for
    `Tensor.backward`), where torch has popped the mode: the recomputation would run native
    fp16 products, whose tensors do not match the forward's saved ones. Non-reentrant
    checkpointing only (`context_fn`); `kwargs` are the caller's other checkpoint options."""
    fn = functools.partial(checkpoint, **{**(kwargs or {}), "use_reentrant": False,
                                          "context_fn": _recompute_emulated})
    for m in model.modules():
        if "_gradient_checkpointing_func" in vars(m):  # where transformers put its own
            m._gradient_checkpointing_func = fn


def autocast(trainer_dtype: str, device: torch.device,
             cpu_fp16: str = "emulate") -> contextlib.AbstractContextManager:
    """Trainer compute precision. fp32 runs without autocast, so it is the true fp32 forward."""
    if trainer_dtype == "fp32":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device.type,
                                       dtype=TORCH_DTYPES[trainer_dtype]))
    stack.enter_context(fp16_kernels(trainer_dtype, device, cpu_fp16))
    return stack


def trainer_precision(trainer_dtype: str, device: torch.device, cpu_fp16: str = "emulate",
                      kernels: str = "default", model: torch.nn.Module | None = None
                      ) -> contextlib.AbstractContextManager:
    """The trainer's forward precision: autocast to `trainer_dtype`, or with kernels=invariant
    the engine's own forward, `model`'s parameters read as their casts to that dtype
    (parity/models/invariant.py)."""
    if kernels == "invariant":
        from parity.models import invariant  # its attention registers with transformers
        return invariant.engine_precision(model, TORCH_DTYPES[trainer_dtype], is_fp32_head)
    return autocast(trainer_dtype, device, cpu_fp16)


def backward_precision(trainer_dtype: str, kernels: str = "default",
                       model: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
    """Where the trainer's backward runs. With kernels=invariant, inside the engine's precision
    again: what a checkpoint recomputes there (the chunked log-probs, gradient checkpointing's
    layers) reads the parameters as their casts, as the forward did, not as the fp32 master.
    Autocast needs nothing: a checkpoint restores autocast's state itself."""
    if kernels == "invariant":
        from parity.models import invariant  # its attention registers with transformers
        return invariant.engine_precision(model, TORCH_DTYPES[trainer_dtype], is_fp32_head)
    return contextlib.nullcontext()


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
        # index in `params` of the first gradient the last skipped step found non-finite (None:
        # none on this rank; under FSDP another rank's shard may hold it)
        self.bad_grad: int | None = None

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
        self.bad_grad = None if finite else next(
            (i for i, p in enumerate(params) if p.grad is not None and not all_finite([p.grad])),
            None)
        if self.enabled:
            # GradScaler skips optimizer.step itself when it found inf/nan while unscaling.
            self.scaler.step(optimizer)
            self.scaler.update()
        elif finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not finite:
            self.skipped += 1
        elif not all_finite(params):
            # A finite gradient can still overflow a parameter (a huge learning rate): stop
            # before such weights reach the engine, a metric or a checkpoint.
            raise ParityError("an optimizer step made parameters non-finite although the "
                              "gradient was finite; lower lr. Nothing was saved from this step")
        return finite, norm

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped = int(state.get("skipped", 0))


@torch.no_grad()
def all_finite(params: list[torch.nn.Parameter]) -> bool:
    """Every element finite (each rank checks its own shards under FSDP)."""
    for p in params:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return False
    return True


@torch.no_grad()
def cast_weights_into(master: torch.nn.Module, target: torch.nn.Module, count: bool = True
                      ) -> float:
    """Copy fp32 master weights into `target` in its own dtype; return the fraction of target
    values that changed (`sync/changed_frac`; 0.0 when not `count`ed). Small updates can leave a
    bf16 cast unchanged. A LoRA master casts its adapted weights (parity/models/lora.py)."""
    if lora.is_lora(master):
        return lora.cast_into(master, target, count)
    src = master.state_dict()
    changed = total = 0
    for name, t in target.state_dict().items():
        # An FSDP shard is gathered whole, one tensor at a time (every rank casts at the same
        # points of the step, in the same order).
        if not (count and t.is_floating_point()):
            t.copy_(full_tensor(src[name]))  # the cast in place: no [V, d] temporary
            continue
        new = full_tensor(src[name]).to(t.dtype)
        changed += (new != t).sum()  # summed on the device: one wait, at the end
        total += t.numel()
        t.copy_(new)
    return int(changed) / max(total, 1)


def _fp32_head_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Outside autocast and any fp16 emulation: the head's product really runs in fp32.
    with torch.autocast(x.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


def is_fp32_head(module: torch.nn.Module) -> bool:
    """Whether `module` is a head that `fp32_head` made compute in fp32."""
    return getattr(module.forward, "__func__", None) is _fp32_head_forward


def fp32_head(model: torch.nn.Module) -> torch.nn.Module:
    """Make the LM head compute in fp32 (MiniMax-M1's fix: it lifts the train/infer probability
    correlation): its forward casts the hidden state and weight to fp32 outside autocast. On a
    low-precision copy the head also keeps its own fp32 weight, untied from the embedding."""
    head = model.get_output_embeddings()
    head.forward = types.MethodType(_fp32_head_forward, head)  # deepcopy rebinds it to the copy
    if head.weight.dtype != torch.float32:
        head.weight = torch.nn.Parameter(head.weight.detach().float().clone(),
                                         requires_grad=head.weight.requires_grad)
    return model


# The hooks an nn.Module keeps per instance.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


def without_patches(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with no hook and no per-instance method left on any of its modules. A deep copy
    keeps whatever a trainer put on the master, and those were written for the master: TRL's
    fp32 head keeps the embedding's output in the master's dtype (fp32 into a bf16 copy's
    layers), its fused-head forward calls the master's own forward, and a patched method
    closes over the master's weights. A copy runs its class's code, in its own dtype."""
    for m in model.modules():
        for name in _HOOK_DICTS:
            if getattr(m, name, None):
                getattr(m, name).clear()
        for name, value in list(vars(m).items()):
            if callable(value) and hasattr(type(m), name):
                del m.__dict__[name]
        m.__dict__.pop("_original_forward", None)  # accelerate's, beside its patched forward
    return model


ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


@torch.no_grad()
def rope_tables_as_master(master: torch.nn.Module, copy_: torch.nn.Module) -> None:
    """RoPE's inverse frequencies in the copy as the master holds them (fp32). A model cast with
    `.to(bf16)` rounds them to bf16, which a model loaded in bf16 (transformers, vLLM) does not:
    its angles, position × frequency, would drift in proportion to the position, a gap that
    grows along the sequence. Matched by order: the copy has the
    master's modules."""
    theirs = [b for n, b in master.named_buffers() if n.rsplit(".", 1)[-1] in ROPE_BUFFERS]
    mine = [(m, n) for m in copy_.modules() for n in ROPE_BUFFERS if n in m._buffers
            and m._buffers[n] is not None]
    if len(theirs) != len(mine):
        return
    for (m, n), b in zip(mine, theirs):
        m._buffers[n] = full_tensor(b).detach().clone()


def low_precision_copy(master: torch.nn.Module, dtype: str, lm_head_fp32: bool = False
                       ) -> torch.nn.Module:
    """An eval-mode, grad-free copy of the master in `dtype` (the engine's or the shadow's),
    without the master's hooks and patched methods (`without_patches`); of a LoRA master, the
    adapted weights as the master's `lora_merge` says (parity/models/lora.py)."""
    if lora.is_lora(master):
        copy_ = lora.engine_copy(master, torch_dtype(dtype))
    else:
        copy_ = copy.deepcopy(master).to(torch_dtype(dtype)).eval()
    rope_tables_as_master(master, copy_)
    without_patches(copy_)
    for p in copy_.parameters():
        p.requires_grad_(False)
    if lm_head_fp32:
        fp32_head(copy_)
        # The head's weight must be the master's fp32 value, not its `dtype` rounding that the
        # cast above made: a sync (cast_weights_into) gives it the fp32 value, so a copy that
        # started from the rounding differs from a synced one until the first sync.
        with torch.no_grad():
            copy_.get_output_embeddings().weight.copy_(
                full_tensor(master.get_output_embeddings().weight).float())
        for p in copy_.parameters():
            p.requires_grad_(False)
    return copy_


# ---- an engine's copy in a checkpoint ----------------------------------------------------------

COPY_WEIGHTS = "engine.safetensors"             # the engine's own low-precision copy
COPY_ADAPTERS = "engine_adapters.safetensors"   # LoRA: the adapters it was last cast from


def save_copy(copy_: torch.nn.Module, directory: Path) -> None:
    """An engine's low-precision copy into a checkpoint's directory, as it was last cast (at the
    step's start, so not a cast of the final weights). A LoRA copy keeps only the adapters it
    was cast from: the base never changes. save_model, not save_file: a tied head (GPT-2) shares
    its tensor with the embedding."""
    synced = getattr(copy_, "parity_synced", None)
    if synced is not None:
        save_file(synced, str(directory / COPY_ADAPTERS))
    else:
        save_model(copy_, str(directory / COPY_WEIGHTS))


def restore_copy(master: torch.nn.Module, copy_: torch.nn.Module, directory: Path) -> None:
    """The copy as `save_copy` left it; a LoRA copy is cast again from `master`'s base with the
    saved adapters."""
    if lora.is_lora(master):
        lora.restore_engine(master, copy_, read_safetensors(directory / COPY_ADAPTERS,
                                                            "checkpoint file"))
    else:
        check_safetensors(directory / COPY_WEIGHTS, "checkpoint file")
        load_model(copy_, str(directory / COPY_WEIGHTS))


def copy_bytes(copy_: torch.nn.Module) -> int:
    """What the copy's tensors take, a tied head's shared tensor once (as save_copy writes it)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in copy_.state_dict().values()}
    return sum(seen.values())
