"""What parity does with a number that is not finite, on every path that trains or measures.

- An update whose loss, ℓ_π or gradient is NaN or inf is skipped, never applied: it is counted
  (`train/skipped_updates`), the first one is named in one warning, and after
  `max_consecutive_skips` in a row the run stops in one line (`Skips`).
- A log-prob that is NaN or inf, or positive (logits in its place, most often), is left out of
  every figure and counted, each kind with one warning (`usable_tokens`, `LeftOutTally`): a
  figure over the rest is still a measurement, a NaN or a logit is not. What counts as positive
  is `above_log_prob`, the one rule for a value no log-prob takes, which the audit's reader of
  rollout files holds too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parity import metric_names as mn
from parity.errors import ParityError


def first_non_finite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor holding a NaN or inf, or None. One check over all of them
    first: asking each tensor would wait for the device once per tensor (hundreds a step for a
    model's gradients); they are named one by one only when one of them is not finite."""
    named = [(n, t) for n, t in named if t is not None and t.is_floating_point()]
    if not named:
        return None
    # The largest |x| of each tensor in one fused pass: inf or NaN exactly where one is there,
    # and, unlike a sum of squares, never an overflow of finite values.
    peaks = torch._foreach_norm([t.detach() for _, t in named], float("inf"))
    if bool(torch.isfinite(torch.stack([p.float().to(peaks[0].device) for p in peaks])).all()):
        return None
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            return name
    return None


@dataclass
class Skips:
    """Updates skipped for a non-finite gradient: how many, how many in a row, and the stop."""
    limit: int                 # max_consecutive_skips; 0: never stop
    total: int = 0
    in_a_row: int = 0
    last_applied: int = 0      # the last step whose update was applied (0: none yet)
    warned: bool = False

    def applied(self, step: int) -> None:
        self.in_a_row, self.last_applied = 0, step

    def skipped(self, step: int, what: str, warn: Callable[[str], None]) -> None:
        """Count a skipped update at `step`, `what` being its first non-finite quantity; warn
        at the first, raise once `limit` were skipped in a row."""
        self.total += 1
        self.in_a_row += 1
        if not self.warned:
            self.warned = True
            warn(f"step {step}: update skipped, {what} is not finite; the weights stay as they "
                 f"were, and skipped updates are counted in {mn.SKIPPED_UPDATES}")
        if self.limit and self.in_a_row >= self.limit:
            since = (f"those of step {self.last_applied}" if self.last_applied
                     else "the initial ones")
            raise ParityError(f"step {step}: {self.in_a_row} updates in a row skipped for a "
                              f"non-finite gradient ({what}; max_consecutive_skips="
                              f"{self.limit}): training stops, its weights {since}, its "
                              f"checkpoints as written")


# A log-prob is <= 0. Rounding lifts a near-certain token's log-softmax a hair above 0 (about
# 1e-7 in float32), never by 1e-3: a value past this is something else, logits most often.
LOG_PROB_MAX = 1e-3


def above_log_prob(x: Any) -> Any:
    """Whether `x`, a number or a tensor (elementwise), lies above every log-probability. NaN
    does not (it is non-finite, and named as such); +inf does."""
    return x > LOG_PROB_MAX


@dataclass(frozen=True)
class LeftOut:
    """Valid tokens left out of the figures, by why: a log-prob NaN or inf (`non_finite`), else
    one above a log-prob (`positive`, `largest` the largest such value; 0 without one)."""
    non_finite: int = 0
    positive: int = 0
    largest: float = 0.0

    def __add__(self, other: LeftOut) -> LeftOut:
        return LeftOut(self.non_finite + other.non_finite, self.positive + other.positive,
                       max(self.largest, other.largest))

    def __bool__(self) -> bool:
        return bool(self.non_finite or self.positive)

    def counts(self) -> dict[str, int]:
        """Both counts under their metric names, 0 included."""
        return {mn.NON_FINITE_TOKENS: self.non_finite, mn.POSITIVE_TOKENS: self.positive}

    def as_tensor(self, device: torch.device | str) -> torch.Tensor:
        """The three figures for a gather across ranks (`gathered` reads it back)."""
        return torch.tensor([self.non_finite, self.positive, self.largest],
                            dtype=torch.float64, device=device)

    @staticmethod
    def gathered(t: torch.Tensor) -> LeftOut:
        """The ranks' `as_tensor`s, concatenated, as one: counts summed, the largest kept."""
        rows = t.detach().reshape(-1, 3).cpu()
        return LeftOut(int(rows[:, 0].sum()), int(rows[:, 1].sum()), float(rows[:, 2].max()))


def usable_tokens(mask: torch.Tensor, *logps: torch.Tensor
                  ) -> tuple[torch.Tensor, list[torch.Tensor], LeftOut]:
    """`mask` without the tokens where any of `logps` is NaN or inf or `above_log_prob`, `logps`
    with 0 there (a masked NaN would still reach a sum), and what that left out of `mask`'s
    tokens. A token with both kinds counts as non-finite."""
    finite = torch.ones(mask.shape, dtype=torch.bool, device=mask.device)
    high = torch.full(mask.shape, -math.inf, dtype=torch.float64, device=mask.device)
    for x in logps:
        finite &= torch.isfinite(x)
        high = torch.maximum(high, torch.where(torch.isfinite(x) & above_log_prob(x),
                                               x.double(), -math.inf))
    valid = mask > 0
    positive = valid & finite & (high > -math.inf)
    ok = finite & (high == -math.inf)
    # One read from the device for all three figures.
    peak = high.masked_fill(~positive, 0.0).amax() if high.numel() else high.new_zeros(())
    n_bad, n_pos, largest = torch.stack([(valid & ~finite).sum().double(),
                                         positive.sum().double(), peak]).tolist()
    return (mask * ok, [x.masked_fill(~ok, 0.0) for x in logps],
            LeftOut(int(n_bad), int(n_pos), largest))


@dataclass
class LeftOutTally:
    """Tokens left out of the figures over a run: counted, each kind named in one warning."""
    what: str                  # where the log-probs came from, for the warning
    total: LeftOut = field(default_factory=LeftOut)

    def add(self, left: LeftOut, warn: Callable[[str], None]) -> None:
        if left.non_finite and not self.total.non_finite:
            warn(f"{left.non_finite} token log-probs from {self.what} are NaN or inf and are "
                 f"left out of every figure (counted in {mn.NON_FINITE_TOKENS})")
        if left.positive and not self.total.positive:
            warn(f"{left.positive} token log-probs from {self.what} are positive, up to "
                 f"{left.largest:g}: these look like logits, not log-probs (a log-prob is "
                 f"<= 0), and are left out of every figure (counted in {mn.POSITIVE_TOKENS})")
        self.total += left
