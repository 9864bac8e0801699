"""No update from a non-finite gradient in TRL's trainers, as in `parity train`.

transformers' Trainer steps its optimizer whatever the gradient holds, so one NaN reaches every
weight (accelerate skips a step only when its fp16 loss scaler overflows). `UpdateGuard` wraps
the optimizer's step once training has prepared it: an update whose loss, ℓ_π or gradient is NaN
or inf is skipped, counted under parity's `train/skipped_updates`, the first one named in one
warning, and the run stops in one line after `max_consecutive_skips` in a row
(parity/runs/finite.py). A skipped update also leaves the learning-rate schedule where it was,
as accelerate's own skip does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from transformers import TrainerCallback

from parity import metric_names as mn
from parity.runs.finite import LeftOut, LeftOutTally, Skips, first_non_finite

logger = logging.getLogger(__name__)


def _warn(message: str) -> None:
    logger.warning("parity: %s", message)


class UpdateGuard(TrainerCallback):
    """Installed by the trainer on itself (`trainer.add_callback`)."""

    def __init__(self, trainer: Any, limit: int):
        self.trainer = trainer
        self.skips = Skips(limit)
        self.noted: str | None = None    # the first non-finite quantity of this update
        self.log_probs = LeftOutTally("the engine (l_mu) or the trainer's forwards")
        self.left_since_log = LeftOut()

    def note(self, name: str, value: torch.Tensor) -> None:
        """Called with ℓ_π, then the loss, of every micro-batch of the update."""
        if self.noted is None and first_non_finite([(name, value.detach())]):
            self.noted = name

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if optimizer is None or getattr(optimizer, "_parity_guarded", False):
            return
        original = optimizer.step

        @functools.wraps(original)   # keeps the marks torch's lr scheduler put on it
        def step(*a: Any, **kw: Any) -> Any:
            return self._step(optimizer, original, *a, **kw)
        optimizer.step = step
        optimizer._parity_guarded = True

    def _step(self, optimizer: Any, original: Any, *a: Any, **kw: Any) -> Any:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        bad = first_non_finite((f"the gradient of {n}", p.grad)
                               for n, p in model.named_parameters() if p.requires_grad)
        out = None
        if bad is None or optimizer.scaler is not None:
            # With fp16 accelerate's GradScaler finds the same NaN or inf and skips the step
            # itself, lowering its scale; `step_was_skipped` then says so.
            out = original(*a, **kw)
        if optimizer.scaler is None:
            optimizer._is_overflow = bad is not None   # accelerate's flag: the schedule waits
        step = self.trainer.state.global_step + 1
        what, self.noted = self.noted or bad, None
        if optimizer.step_was_skipped:
            self.skips.skipped(step, what or "the gradient (fp16 loss scale overflow)", _warn)
        else:
            self.skips.applied(step)
        return out

    def add_to(self, logs: dict[str, float]) -> None:
        """parity's counts in a training log line: skipped updates in total, log-probs left out
        since the last line, each kind on every line once the run has met it."""
        logs[mn.SKIPPED_UPDATES] = self.skips.total
        seen = self.log_probs.total.counts()
        logs.update({k: n for k, n in self.left_since_log.counts().items() if seen[k]})
        self.left_since_log = LeftOut()

    def left_out(self, left: LeftOut) -> None:
        self.log_probs.add(left, _warn)
        self.left_since_log += left
