"""Where a run computes: the `device` setting, resolved once per process.

`auto` takes the rank's CUDA device when torch sees CUDA (LOCAL_RANK under torchrun and
accelerate launch, one GPU per rank), else the CPU; `cpu`, `cuda` and `cuda:N` are explicit, and
an explicit CUDA device that is not there is refused before any work starts. Every model copy,
optimizer state and rollout tensor then lives on that device; the sampling generator stays on
the CPU (its draws are copied to the device), so a seed samples from the same random numbers on
every device and a checkpoint's generator state is the same object everywhere.
"""

from __future__ import annotations

import os
import re

import torch

from parity import cpu_bf16
from parity.errors import ParityError


def check_setting(setting: str) -> None:
    """The config checks the field (parity/config/run.py, `device`); a caller of the library may
    pass any text."""
    if setting not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", setting):
        raise ParityError(f"device={setting!r} must be auto, cpu, cuda or cuda:N")


def resolve(setting: str) -> torch.device:
    """The torch device of `setting` for this process; a CUDA device that this machine does not
    have is a ParityError."""
    check_setting(setting)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        cpu_bf16.install()  # bf16 products at fp32's speed where the CPU lacks bf16 instructions
        return torch.device("cpu")
    if setting == "auto":
        setting = f"cuda:{local_rank % torch.cuda.device_count()}"
    if not torch.cuda.is_available():
        raise ParityError(f"device={setting}: torch sees no CUDA device on this machine "
                          f"(torch {torch.__version__}, CUDA build: "
                          f"{torch.version.cuda or 'no'}); use --device cpu or auto")
    index = int(setting.split(":")[1]) if ":" in setting else local_rank
    if index >= torch.cuda.device_count():
        raise ParityError(f"device={setting}: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), numbered from 0")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)  # NCCL and the CUDA caching allocator work on this one
    return device


def backend(device: torch.device) -> str:
    """The process group's backend for ranks computing on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a stage's wall time is its own (CUDA kernels
    run asynchronously to the Python that queues them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """The device in words, for run headers and benchmark tables."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads, {cpu_bf16.describe()})"
