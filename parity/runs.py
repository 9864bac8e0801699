"""What every command that runs a model shares: loading a policy and its tokenizer, the model's
context length, and run directories that never overwrite an earlier run.

`parity train`, `audit`, `fp16-check`, `sweep` and the benches import these; none of them
imports the trainer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity import testbed
from parity.errors import ParityError, one_line

if TYPE_CHECKING:
    from parity.config import Config
    from parity.tasks import Task


def load_policy(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """fp32 master weights and the tokenizer; a directory that is not a causal LM is a user error."""
    transformers.utils.logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except Exception as e:
        raise ParityError(f"cannot load a causal LM from {model_dir}: {one_line(e)}") from None
    if tok.eos_token_id is None:
        raise ParityError(f"the tokenizer in {model_dir} has no eos token; completions could "
                          f"never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def max_positions(model: torch.nn.Module) -> int | None:
    """The model's context length, where its config states one."""
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def load_model_and_task(cfg: "Config") -> tuple[torch.nn.Module, Any, Path, "Task"]:
    """The run's policy (fp32), tokenizer, model directory and task, as `cfg` names them."""
    from parity.tasks import build_task
    model_dir = testbed.resolve_model(cfg.model)
    model, tok = load_policy(model_dir)
    task = build_task(cfg.task, cfg.reward_specs(), model_dir, model, tok, cfg.max_new_tokens,
                      max_positions(model), cfg.seed, cfg.temperature,
                      cfg.reward_weight_list(), cfg.chat_template)
    return model, tok, model_dir, task


# ---- run directories ---------------------------------------------------------------------

def free_dir(base: Path) -> Path:
    """`base`, or base-2, base-3, ... : the first that does not exist yet, so repeating a
    command never collides with the output of the one before it."""
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def run_dir_for(cfg: "Config") -> Path:
    """--out as given; otherwise the first free runs/<task>-<recipe>-s<seed>[-N]."""
    if cfg.out:
        return Path(cfg.out)
    return free_dir(Path("runs") / f"{Path(cfg.task).stem}-{cfg.recipe}-s{cfg.seed}")


def check_run_dir(path: Path) -> None:
    """Never overwrite an earlier run: a run directory must stay consistent with its metrics."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ParityError(f"run directory {path} already exists and is not empty; choose "
                          f"another --out")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past the checkpoint a run resumes from (and a torn last line), atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a line cut by the crash: nothing after it was written either
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)
