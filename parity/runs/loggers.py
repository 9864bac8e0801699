"""Metric backends besides metrics.jsonl: TensorBoard and Weights & Biases (offline only).

metrics.jsonl is the run's record: the trainer writes it first, line-buffered, and resume truncates
it to the restored checkpoint. The backends are views of the same numbers in tools people already
use, so they follow it: the same names per step, rewound with it on resume, and a backend that
fails while training is dropped with a warning instead of stopping the run (its numbers are safe
in metrics.jsonl). Only a backend that was asked for by name and cannot be imported is an error,
raised before the run directory exists.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from parity.errors import ParityError, one_line
from parity.files import read_text

BACKENDS = ("tensorboard", "wandb")


def _warn(msg: str) -> None:
    print(f"parity: warning: {msg}", file=sys.stderr)


def _import(name: str) -> Any:
    if name == "wandb":
        # Set before wandb-core starts: no banner or login prompt, and no crash reports sent over
        # the network. A value the user set wins.
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        if not os.environ.get("HOME") and not os.environ.get("XDG_CACHE_HOME"):
            # wandb-core finds its log and cache directories from these; with neither it logs
            # every line of its own to stderr. The user's home from the password database, as
            # HOME would give it (or the temporary directory, where there is none).
            home = os.path.expanduser("~")
            os.environ["XDG_CACHE_HOME"] = os.path.join(
                home if home != "~" and os.access(home, os.W_OK) else tempfile.gettempdir(),
                ".cache")
        import wandb  # optional: parity[logging]
        return wandb
    # torch's writer; it raises ImportError when the tensorboard package is missing.
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter


def _switched_off(name: str) -> bool:
    """Whether the backend's own off switch (its class's OFF: an environment variable and the
    value that turns it off) keeps `auto` from taking it. Asked for by name, it still logs."""
    off = _OPEN[name].OFF
    return off is not None and os.environ.get(off[0], "").strip().lower() == off[1]


def check_backends(report_to: str) -> list[str]:
    """The backends `report_to` selects (names already validated by Config). A named one that does
    not import is a ParityError; `auto` takes each one that imports. Call it before writing
    anything, so a missing package never leaves a half-made run directory behind."""
    names = {n.strip() for n in report_to.split(",")}
    chosen = []
    for b in BACKENDS:
        if b not in names and ("auto" not in names or _switched_off(b)):
            continue
        try:
            _import(b)
        except Exception as e:
            if b in names:
                raise ParityError(f"report_to={b} needs the {b} package, which does not import "
                                  f"({one_line(e)}): pip install {b}") from None
            if not isinstance(e, ImportError):  # installed but broken: say so, don't hide it
                _warn(f"{b} is installed but does not import ({one_line(e)}); not logging to it")
            continue
        chosen.append(b)
    return chosen


def _is_number(v: Any) -> bool:
    # metrics.jsonl writes a non-finite value as null; the backends get no point for it.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _TensorBoard:
    OFF = None

    def __init__(self, run: Path, config: dict[str, Any], resume_step: int | None):
        SummaryWriter = _import("tensorboard")
        # purge_step: readers drop the earlier events from this step on, as resume truncates
        # metrics.jsonl; the recomputed steps then appear once.
        self.writer = SummaryWriter(log_dir=str(run / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # like metrics.jsonl, a finished step is on disk (and on the board)

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    ID_FILE = "wandb-id"
    # wandb's own switch: a user who set it expects no W&B run, and importing wandb and starting
    # wandb-core costs seconds a run, which a sweep of short runs pays per run
    # (docs/performance.md, "report_to=auto and wandb").
    OFF = ("WANDB_MODE", "disabled")

    def __init__(self, run: Path, config: dict[str, Any], resume_step: int | None):
        wandb = _import("wandb")
        # One id per run directory, so a resumed run continues the same W&B run. Offline, each
        # process writes its own wandb/offline-run-*-<id>; synced in order, they make one run,
        # and W&B ignores a step below the run's latest, so recomputed steps are not doubled.
        id_file = run / self.ID_FILE
        if id_file.is_file():
            run_id = read_text(id_file, "W&B run id file").strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        # No console capture (parity's own output is not a metric), and no system or host probes
        # (some query cloud metadata addresses). Settings forbids unknown names, and the x_ ones
        # are wandb's experimental ones, so only those this version has are passed.
        opts = dict(silent=True, console="off", save_code=False, disable_git=True,
                    x_disable_stats=True, x_disable_meta=True)
        settings = wandb.Settings(**{k: v for k, v in opts.items()
                                     if k in wandb.Settings.model_fields})
        self.run = wandb.init(mode="offline", dir=str(run.resolve()), project="parity",
                              name=run.resolve().name, config=config, id=run_id, resume="allow",
                              settings=settings)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


_OPEN = {"tensorboard": _TensorBoard, "wandb": _WandB}


class MetricLoggers:
    """The `backends` check_backends chose, for one run directory. `resume_step`: the step a
    resumed run restarts after (the restored checkpoint's, 0 with none), None for a new run.
    Use as a context manager, so the backends are closed (and flushed) however the run ends."""

    def __init__(self, run: Path, backends: list[str], config: dict[str, Any],
                 resume_step: int | None):
        self.backends: dict[str, Any] = {}
        for name in backends:
            try:
                self.backends[name] = _OPEN[name](run, config, resume_step)
            except Exception as e:
                _warn(f"{name} logging did not start ({one_line(e)}); metrics.jsonl has every step")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's metrics, by the names metrics.jsonl uses (`step` is the x axis)."""
        scalars = {k: v for k, v in metrics.items() if k != "step" and _is_number(v)}
        for name, backend in list(self.backends.items()):
            try:
                backend.log(step, scalars)
            except Exception as e:
                del self.backends[name]
                _warn(f"{name} logging failed at step {step} ({one_line(e)}); stopped logging to "
                      f"it, metrics.jsonl has every step")
                self._close(name, backend, failed=True)

    def _close(self, name: str, backend: Any, failed: bool) -> None:
        try:
            backend.close(failed)
        except Exception as e:
            _warn(f"{name} logging did not close cleanly ({one_line(e)})")

    def close(self, failed: bool = False) -> None:
        backends, self.backends = self.backends, {}
        for name, backend in backends.items():
            self._close(name, backend, failed)

    def __enter__(self) -> "MetricLoggers":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None)
