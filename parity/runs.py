"""What every command that runs a model shares: loading a policy and its tokenizer, the model's
context length, and run directories that never overwrite an earlier run.

`parity train`, `audit`, `fp16-check`, `sweep` and the benches import these; none of them
imports the trainer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from parity import testbed
from parity.errors import ParityError, one_line
from parity.files import (
    check_safetensors,
    ensure_writable,
    quiet_libraries,
    read_bytes,
    write_atomic,
)

if TYPE_CHECKING:
    from parity.config import Config
    from parity.tasks import Task


# Model types whose transformers "causal LM" class is an encoder run as a decoder: their
# weights were trained bidirectionally, so their log-probs are not a policy's.
ENCODER_ONLY = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                "deberta-v2", "camembert", "ernie", "mpnet", "modernbert")


def _causal_lm_config(model_dir: Path) -> Any:
    """The model's config, refused unless it describes a decoder-only language model."""
    try:
        with quiet_libraries():
            config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise ParityError(f"cannot load a causal LM from {model_dir}: {one_line(e)}") from None
    names = list(getattr(config, "architectures", None) or [])
    causal = [n for n in names if n.endswith(("ForCausalLM", "LMHeadModel"))]
    if config.model_type in ENCODER_ONLY and not getattr(config, "is_decoder", False) or (
            names and not causal):
        what = f"{config.model_type} ({', '.join(names)})" if names else config.model_type
        raise ParityError(f"{model_dir} is not a causal LM: its config describes {what}, an "
                          f"encoder or another head; parity trains decoder-only language models")
    return config


def _check_weights_fit(model: torch.nn.Module, info: dict, model_dir: Path) -> None:
    """Refuse a config.json that disagrees with the weights beside it: transformers would
    otherwise initialise the missing layers at random, or stop after a long report."""
    tied = ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False)
            else set())
    missing = sorted(k for k in info.get("missing_keys", ()) if k not in tied)
    mismatched = sorted(info.get("mismatched_keys", ()))
    unexpected = sorted(info.get("unexpected_keys", ()))
    if mismatched:
        k = mismatched[0]
        detail = (f"{k[0]} is {tuple(k[1])} in the weights but {tuple(k[2])} by config.json"
                  if isinstance(k, tuple) and len(k) == 3 else str(k))
        raise ParityError(f"{model_dir}: config.json does not match the weights ({detail}; "
                          f"{len(mismatched)} tensors differ in shape: a vocabulary or width "
                          f"that does not match?)")
    if missing or unexpected:
        which = (f"{len(missing)} weights config.json asks for are not in the files, e.g. "
                 f"{missing[0]}" if missing else
                 f"{len(unexpected)} weights in the files are not in config.json's model, e.g. "
                 f"{unexpected[0]}")
        raise ParityError(f"{model_dir}: config.json does not match the weights: {which} (a "
                          f"layer count that does not match?)")


def load_policy(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """fp32 master weights and the tokenizer. A directory that is not a causal LM, or whose
    config.json disagrees with its weights, is a user error."""
    config = _causal_lm_config(model_dir)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        check_safetensors(f, "weights file")
    try:
        with quiet_libraries():
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=torch.float32, output_loading_info=True,
                ignore_mismatched_sizes=True)
    except Exception as e:
        raise ParityError(f"cannot load a causal LM from {model_dir}: {one_line(e)}") from None
    _check_weights_fit(model, info, model_dir)
    try:
        with quiet_libraries():
            tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ParityError(f"cannot load the tokenizer in {model_dir}: {one_line(e)}") from None
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

def free_dir(base: Path, suffix: str = "") -> Path:
    """`base`, or base-2, base-3, ... (each with `suffix` after it): the first that does not
    exist yet, so repeating a command never collides with the output of the one before it."""
    path, n = base.with_name(base.name + suffix), 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}{suffix}")
    return path


def run_dir_for(cfg: "Config") -> Path:
    """--out as given; otherwise the first free runs/<task>-<recipe>-s<seed>[-N]."""
    if cfg.out:
        return Path(cfg.out)
    return free_dir(Path("runs") / f"{Path(cfg.task).stem}-{cfg.recipe}-s{cfg.seed}")


def check_run_dir(path: Path) -> None:
    """Never overwrite an earlier run: a run directory must stay consistent with its metrics.
    One that could not be created or written is refused here too, before any work."""
    ensure_writable(path, "output directory")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ParityError(f"run directory {path} already exists and is not empty; choose "
                          f"another --out")


class RunClaim:
    """An output directory held by this process for as long as its command lasts: an exclusive
    lock on the directory itself (flock), so a second parity command writing it is refused, and
    one that crashes or is killed leaves nothing stuck (the kernel drops the lock with the
    process). Nothing is written into the directory to hold it. Used as a context manager, a
    directory the claim created and the command left empty is removed when the command fails:
    a refused command leaves nothing behind (docs/errors.md)."""

    def __init__(self, fd: int, path: Path | None = None, created: bool = False) -> None:
        self.fd, self.path, self.created = fd, path, created

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        try:
            if error is not None and self.created and self.path is not None:
                with contextlib.suppress(OSError):  # not empty: it holds work, which stays
                    self.path.rmdir()
        finally:
            self.close()

    def __del__(self) -> None:  # a run that failed while building: the lock goes with it
        self.close()


def claim_dir(path: Path, what: str, *, create: bool = True, empty: bool = False) -> RunClaim:
    """Hold the output directory `path` (`what` names it in a refusal: "run directory", "sweep
    --out") for one command: the one lock of every command that writes a directory, so of two
    started at once with one --out exactly one proceeds and the other is refused in one line
    before it writes anything. `create`: make it if absent; `empty`: refuse one that is not
    empty once held (a new run or audit never mixes into earlier output)."""
    for _ in range(8):
        created = False
        try:
            if create:
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    path.mkdir()
                    created = True
                except FileExistsError:
                    pass
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise ParityError(f"{what} {path}: {e.strerror or one_line(e)}") from None
        claim = RunClaim(fd, path, created)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            claim.close()
            raise ParityError(f"{what} {path} is in use by another parity run still writing "
                              f"it; choose another --out, or wait for that run to end") from None
        except OSError:
            pass  # a file system without locks (some network ones): the emptiness check holds
        # The directory locked must still be the one at `path`: another command that created it
        # and was refused removes it, and a lock on a removed directory holds nothing.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if not same:
            claim.close()
            if create:
                continue
            raise ParityError(f"{what} {path}: no such directory")
        if empty and any(path.iterdir()):
            claim.close()
            raise ParityError(f"{what} {path} already exists and is not empty; choose "
                              f"another --out")
        return claim
    raise ParityError(f"{what} {path} keeps being removed while parity claims it; choose "
                      f"another --out")


def claim_run_dir(path: Path, new: bool) -> RunClaim:
    """Hold `path` for this run. A new run creates it (or takes an empty one) and checks it is
    still empty once held. A resumed run holds its directory before it reads or repairs
    anything in it."""
    return claim_dir(path, "run directory", create=new, empty=new)


# What each command leaves at the top of its output directory, to tell one command's directory
# from another's.
OUTPUT_MARKS = {"config.yaml": "a training run", "audit.json": "an audit",
                "scale.json": "a scale audit", "fp16_check.json": "an fp16 check",
                "summary.json": "a sweep", "claims.json": "a reproduction"}


def refuse_other_output(path: Path, mine: str, what: str) -> None:
    """Refuse to write a command's output (`mine`, as OUTPUT_MARKS names it) into a directory
    another command wrote: a sweep's runs and summary would mix into a training run's files."""
    for name, owner in OUTPUT_MARKS.items():
        if owner != mine and (path / name).exists():
            raise ParityError(f"{what} {path} holds {owner} ({name}), not {mine}; choose "
                              f"another --out")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the lines past the checkpoint a run resumes from (it logs those steps again),
    atomically. A line that cannot be read (cut by a crash, or damaged anywhere in the file) is
    kept aside in metrics-unreadable[-N].jsonl, named in a warning, and never stops the
    readable lines after it from being kept: nothing readable up to `last_step` is lost."""
    if not path.is_file():
        return
    keep, damaged = [], []
    for line in metrics_lines(path):
        if line.row is None:
            damaged.append((line.number, line.raw))
        elif line.row["step"] <= last_step:
            keep.append(line)
    if damaged:
        aside = free_dir(path.with_name("metrics-unreadable"), ".jsonl")
        write_atomic(aside, b"".join(raw + b"\n" for _, raw in damaged), "metrics file")
        have = {line.row['step'] for line in keep if line.row is not None}
        lost = [s for s in range(1, last_step + 1) if s not in have]
        print(f"parity: warning: {path}: line {', '.join(str(n) for n, _ in damaged)} could not "
              f"be read (cut or not JSON) and {'is' if len(damaged) == 1 else 'are'} kept in "
              f"{aside.name}; every readable step is kept"
              + (f"; the metrics of step {_ranges(lost)} are missing" if lost else ""),
              file=sys.stderr)
    write_atomic(path, b"".join(line.raw + b"\n" for line in keep), "metrics file")


class MetricsLine(NamedTuple):
    number: int                  # the line's number in the file, from 1
    offset: int                  # its first byte's offset in the file
    raw: bytes                   # as written, without its newline
    row: dict[str, Any] | None   # its record; None when the line is not a whole one


def metrics_lines(path: Path) -> list[MetricsLine]:
    """Every non-blank line of a metrics.jsonl, as whatever reads one sees it (`--resume`, the
    reports, a sweep's check of a finished run): a line is a record when it is a JSON object
    with an integer step; any other line (cut by a kill mid-write, or damaged) is kept as it
    is, for the caller to name, and never hides the readable lines after it."""
    out, offset = [], 0
    for n, raw in enumerate(read_bytes(path, "metrics file").split(b"\n"), start=1):
        if raw.strip():
            out.append(MetricsLine(n, offset, raw, _record(raw)))
        offset += len(raw) + 1
    return out


def _record(raw: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def unreadable(path: Path, damaged: list[MetricsLine]) -> str:
    """The unreadable lines of a metrics file named for a warning: each line's number, and
    where one is not UTF-8 text, its first such byte and that byte's offset."""
    parts = []
    for line in damaged:
        try:
            line.raw.decode("utf-8")
            parts.append(f"line {line.number}")
        except UnicodeDecodeError as e:
            parts.append(f"line {line.number} (byte 0x{line.raw[e.start]:02x} at offset "
                         f"{line.offset + e.start} is not UTF-8)")
    return (f"{path}: {', '.join(parts)} could not be read (cut or not JSON, "
            f"{'a line' if len(parts) == 1 else 'lines'} a killed or damaged run leaves)")


def _ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    out: list[str] = []
    for s in steps:
        if out and s - 1 == int(out[-1].split("-")[-1]):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def set_aside_metrics(run: Path) -> Path | None:
    """A run resumed with no checkpoint starts again from step 1. The steps it had logged are
    kept beside it (metrics-before-restart[-N].jsonl), never overwritten."""
    path = run / "metrics.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return None
    dest = free_dir(run / "metrics-before-restart", ".jsonl")
    os.replace(path, dest)
    return dest
