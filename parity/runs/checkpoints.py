"""Checkpoints that survive crashes, and everything a resumed run needs to continue exactly.

    checkpoints/step-N/   model.safetensors + tokenizer (an ordinary HF directory, fp32)
                          engine.safetensors      the engine's own low-precision copy
                          (LoRA: adapter_model.safetensors + adapter_config.json instead of the
                          model, engine_adapters.safetensors instead of the engine's copy)
                          value_head.safetensors  (ppo-value)
                          engine-vN.safetensors   (async engine) pushed versions still in use
                          train.pt                optimizer and loss-scaler state
                          rng.pt                  torch, sampling-generator and Python RNG states
                          state.json              step, engine version, data order
                          manifest.json           sha256 and size of every file above

A checkpoint is written to `.tmp-step-N/`, its manifest last, then renamed into place: a crash
leaves either the whole checkpoint or none. On resume the newest checkpoint whose files match
its manifest is used; a corrupt one is skipped with a warning. Only `torch.load(weights_only=
True)` and safetensors read anything back.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from parity.errors import ParityError, one_line
from parity.files import (
    free_bytes,
    is_disk_full,
    read_safetensors,
    read_torch,
    write_failure,
)
from parity.models import lora

if TYPE_CHECKING:
    from parity.engines import Engine

MANIFEST = "manifest.json"
ADAPTERS = "adapter_model.safetensors"          # a LoRA run's adapters (peft's own file name)
# What a resumed run reads from state.json; a checkpoint without one of them is not valid.
STATE_KEYS = ("step", "engine_version", "prompts")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run: Path, step: int, model: torch.nn.Module, tok: Any, engine: Engine,
         engine_version: int, opt: torch.optim.Optimizer, scaler_state: dict, prompts_state: dict,
         gen: torch.Generator, value_head: torch.nn.Module | None, keep: int,
         async_state: dict[str, Any] | None = None,
         engine_versions: dict[int, dict[str, torch.Tensor]] | None = None,
         model_state: dict[str, torch.Tensor] | None = None, opt_state: dict | None = None
         ) -> Path:
    try:
        return _save(run, step, model, tok, engine, engine_version, opt, scaler_state,
                     prompts_state, gen, value_head, keep, async_state, engine_versions,
                     model_state, opt_state)
    except (OSError, RuntimeError, SafetensorError) as e:
        # The checkpoints path became a file, the disk filled (torch and safetensors wrap the
        # system's error in their own), ... The partial write goes, to free its space.
        tmp = run / "checkpoints" / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        failure = _save_failure(e, run, step, model, engine)
        if failure is None:
            raise
        raise failure from None


def _save_failure(e: BaseException, run: Path, step: int, model: torch.nn.Module,
                  engine: Engine) -> ParityError | None:
    """One line: what could not be written, the space it needs (the newest checkpoint's size,
    or the tensors' where none is on disk yet), and that nothing written before is lost. None
    for a library error that is not the disk's (torch reports a full disk only as a stream
    error: the free space tells)."""
    path = run / "checkpoints" / f"step-{step}"
    done = steps_on_disk(run) if (run / "checkpoints").is_dir() else []
    done = [s for s in done if s != step]
    needed = _bytes_on_disk(run / "checkpoints" / f"step-{done[-1]}") if done else sum(
        t.numel() * t.element_size() for t in model.state_dict().values()
    ) + engine.weight_bytes() + 3 * sum(p.numel() * 4 for p in model.parameters()
                                        if p.requires_grad)  # gradients' moments and master
    kept = f"checkpoint step-{done[-1]} stays whole to resume from" if done else \
        "no checkpoint was written yet"
    free = free_bytes(run)
    full = is_disk_full(e) or (free is not None and free < needed)
    if not full and not isinstance(e, OSError):
        return None
    if full:
        return write_failure(e, path, needed, f"the checkpoint of step {step} to", after=(
            f"; the partial write was removed, {kept}, and metrics.jsonl holds every step so "
            f"far: free some space, then `parity train --resume {run}`"), full=True)
    return ParityError(f"cannot write the checkpoint of step {step} under {run / 'checkpoints'}"
                       f": {one_line(e)}; metrics.jsonl holds every step so far, and "
                       f"`--resume` continues from the newest checkpoint on disk")


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _save(run: Path, step: int, model: torch.nn.Module, tok: Any, engine: Engine,
          engine_version: int, opt: torch.optim.Optimizer, scaler_state: dict,
          prompts_state: dict, gen: torch.Generator, value_head: torch.nn.Module | None,
          keep: int, async_state: dict[str, Any] | None,
          engine_versions: dict[int, dict[str, torch.Tensor]] | None,
          model_state: dict[str, torch.Tensor] | None, opt_state: dict | None) -> Path:
    weights = model_state if model_state is not None else model.state_dict()
    bad = next((k for k, v in weights.items() if v.is_floating_point()
                and not bool(torch.isfinite(v).all())), None)
    if bad is not None:  # never write weights no run could use
        raise ParityError(f"step {step}: parameter {bad} is not finite; the checkpoint is not "
                          f"written (the newest one on disk stays the one to resume from)")
    final = run / "checkpoints" / f"step-{step}"
    tmp = run / "checkpoints" / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # FSDP: the caller gathered the whole weights and optimizer state (collectives every rank
    # takes part in); rank 0 writes them as a one-process run would.
    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    tok.save_pretrained(tmp)
    engine.save_weights(tmp)   # as last synced: not a cast of the final weights
    if value_head is not None:
        save_file(value_head.state_dict(), str(tmp / "value_head.safetensors"))
    for v, weights in (engine_versions or {}).items():
        save_file(weights, str(tmp / f"engine-v{v}.safetensors"))
    torch.save({"optimizer": opt_state if opt_state is not None else opt.state_dict(),
                "scaler": scaler_state}, tmp / "train.pt")
    # The CUDA stream draws only dropout kept on (`keep_dropout`) on a GPU; kept all the same.
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    torch.save({"torch": torch.get_rng_state(), "sampling": gen.get_state(),
                "python": random.getstate(), "cuda": cuda_rng}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "engine_version": engine_version,
                                                "prompts": prompts_state,
                                                **({"async": async_state} if async_state
                                                   else {})}))
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    for p in tmp.iterdir():
        with p.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    prune(run, keep)
    return final


def steps_on_disk(run: Path) -> list[int]:
    d = run / "checkpoints"
    if not d.exists():
        return []
    if not d.is_dir():
        raise ParityError(f"{d} is not a directory: the run's checkpoints cannot be read. "
                          f"Nothing was changed; move it aside to start the run again")
    return sorted(int(p.name[5:]) for p in d.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())


def prune(run: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (0: all)."""
    if keep > 0:
        for s in steps_on_disk(run)[:-keep]:
            shutil.rmtree(run / "checkpoints" / f"step-{s}", ignore_errors=True)


def verify(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    m = path / MANIFEST
    if not m.is_file():
        return "no manifest.json"
    try:
        files = json.loads(m.read_text(encoding="utf-8"))["files"]
        for name, meta in files.items():
            p = path / name
            if not p.is_file():
                return f"{name} is missing"
            if p.stat().st_size != meta["bytes"]:
                return f"{name} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}"
            if _sha256(p) != meta["sha256"]:
                return f"{name} does not match its checksum"
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            return f"state.json lacks {missing[0]!r}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        # Any manifest or state that cannot be read as written is "not valid", never a crash.
        return f"its manifest or state is not readable ({type(e).__name__}: {one_line(e)})"
    return None


@dataclass
class Restored:
    step: int
    path: Path
    state: dict[str, Any]


def latest_valid(run: Path) -> Restored | None:
    """The newest checkpoint that verifies; each corrupt one is named in a warning. None when
    the run stopped before its first checkpoint: it starts again from step 1."""
    steps = steps_on_disk(run)
    if not steps:
        print(f"parity: warning: {run} has no checkpoint yet; starting it again from step 1",
              file=sys.stderr)
        return None
    for s in reversed(steps):
        path = run / "checkpoints" / f"step-{s}"
        problem = verify(path)
        if problem is None:
            return Restored(s, path, json.loads((path / "state.json").read_text(encoding="utf-8")))
        print(f"parity: warning: checkpoint {path} is corrupt ({problem}); trying an older one",
              file=sys.stderr)
    raise ParityError(f"{run}: every checkpoint is corrupt ({', '.join(f'step-{s}' for s in steps)}"
                      f"); nothing to resume from")


def load_into(r: Restored, model: torch.nn.Module, engine: Engine,
              gen: torch.Generator, value_head: torch.nn.Module | None) -> dict:
    """Restore weights and RNGs in place; returns train.pt's {"optimizer", "scaler"} states,
    which the caller loads once its optimizer exists (under FSDP, on the shards)."""
    try:
        _load_weights(r, model, engine, value_head)
    except RuntimeError as e:  # torch's "size mismatch for ...": another model than was saved
        first = next((x.strip() for x in str(e).splitlines() if "mismatch" in x), one_line(e))
        raise ParityError(f"{r.path}: the checkpoint's weights do not fit the run's model "
                          f"({first[:200]}); was the run's "
                          f"config.yaml edited to another model? It must name the one the run "
                          f"started with") from None
    rng = read_torch(r.path / "rng.pt", "checkpoint file")
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    gen.set_state(rng["sampling"])
    random.setstate(_as_tuple(rng["python"]))
    # On the CPU whatever device wrote it: the optimizer moves its state to its parameters'.
    return read_torch(r.path / "train.pt", "checkpoint file")


def _read(path: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(path, "checkpoint file")


def _load_weights(r: Restored, model: torch.nn.Module, engine: Engine,
                  value_head: torch.nn.Module | None) -> None:
    if lora.is_lora(model):
        if not (r.path / ADAPTERS).is_file():
            raise ParityError(f"{r.path} holds no LoRA adapters: it was written by a run "
                              f"without --lora-rank")
        engine.restore_weights(model, r.path)  # cast from the base and its saved adapters
        lora.load_adapter_state(model, _read(r.path / ADAPTERS))
    else:
        weights = _read(r.path / "model.safetensors")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k not in _tied(model)]:
            raise ParityError(f"{r.path}: the checkpoint's weights do not fit the run's model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        engine.restore_weights(model, r.path)
    if value_head is not None:
        value_head.load_state_dict(_read(r.path / "value_head.safetensors"))


def engine_versions(r: Restored) -> dict[int, dict[str, torch.Tensor]]:
    """The async engine's pushed weight versions a checkpoint kept (empty for a synchronous
    run)."""
    return {int(v): _read(r.path / f"engine-v{v}.safetensors")
            for v in r.state.get("async", {}).get("pushed", [])}


def _tied(model: torch.nn.Module) -> set[str]:
    # save_pretrained drops a tied output embedding; it comes back with the input embedding.
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
