"""Run directories: the lock every command that writes one takes, names that never overwrite an
earlier run, and the one reader of a run's metrics.jsonl.

`parity train`, `audit`, `fp16-check`, `sweep`, `reproduce` and `report` use these.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from parity.errors import ParityError, one_line
from parity.files import ensure_writable, read_bytes, write_atomic

if TYPE_CHECKING:
    from parity.config import Config


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


class DirLock:
    """An output directory held by this process for as long as its command lasts: an exclusive
    lock on the directory itself (flock), so a second parity command writing it is refused, and
    one that crashes or is killed leaves nothing stuck (the kernel drops the lock with the
    process). Nothing is written into the directory to hold it. Used as a context manager, a
    directory the lock created and the command left empty is removed when the command fails:
    a refused command leaves nothing behind (docs/errors.md)."""

    def __init__(self, fd: int, path: Path | None = None, created: bool = False) -> None:
        self.fd, self.path, self.created = fd, path, created

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirLock":
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


def lock_dir(path: Path, what: str, *, create: bool = True, empty: bool = False) -> DirLock:
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
        lock = DirLock(fd, path, created)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
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
            lock.close()
            if create:
                continue
            raise ParityError(f"{what} {path}: no such directory")
        if empty and any(path.iterdir()):
            lock.close()
            raise ParityError(f"{what} {path} already exists and is not empty; choose "
                              f"another --out")
        return lock
    raise ParityError(f"{what} {path} keeps being removed while parity locks it; choose "
                      f"another --out")


def lock_run_dir(path: Path, new: bool) -> DirLock:
    """Hold `path` for this run. A new run creates it (or takes an empty one) and checks it is
    still empty once held. A resumed run holds its directory before it reads or repairs
    anything in it."""
    return lock_dir(path, "run directory", create=new, empty=new)


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
    # a step no run reaches (past int64, as no float holds it) is damage, not a step
    return (row if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**63
            else None)


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
