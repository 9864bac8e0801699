"""What parity does with a number that is not finite, on every path that trains or measures.

- An update whose loss, ℓ_π or gradient is NaN or inf is skipped, never applied: it is counted
  (`train/skipped_updates`), the first one is named in one warning, and after
  `max_consecutive_skips` in a row the run stops in one line (`Skips`).
- A log-prob that is NaN or inf is left out of every figure and counted, with one warning
  (`finite_tokens`, `NonFinite`): a figure over the rest is still a measurement, a NaN is not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

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


def finite_tokens(mask: torch.Tensor, *logps: torch.Tensor
                  ) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """`mask` without the tokens where any of `logps` is NaN or inf, `logps` with 0 there (a
    masked NaN would still reach a sum), and how many tokens of `mask` that left out."""
    ok = torch.ones(mask.shape, dtype=torch.bool, device=mask.device)
    for x in logps:
        ok &= torch.isfinite(x)
    left_out = int(((mask > 0) & ~ok).sum())
    return mask * ok, [x.masked_fill(~ok, 0.0) for x in logps], left_out


@dataclass
class NonFinite:
    """Log-probs left out of the figures: counted over a run, named in one warning."""
    what: str                  # where they came from, for the warning
    total: int = 0

    def add(self, n: int, warn: Callable[[str], None]) -> None:
        if n and not self.total:
            warn(f"{n} token log-probs from {self.what} are NaN or inf and are left out of "
                 f"every figure (counted in {mn.NON_FINITE_TOKENS})")
        self.total += n
