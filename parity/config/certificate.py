"""The zero-mismatch certificate: `parity audit --certify RULE` (docs/zero-mismatch.md).

Three checks, as the bitwise RL stacks run them, each judged exactly (`==`, never a
tolerance), on what `--locate` measures:

    trainer layouts   the trainer at micro-batch 1 and at the audit's, padded on the left and
                      on the right: every token's log-prob
    trainer vs engine the trainer's log-probs against the engine's decode, every sampled
                      token; and the engine's prefill against the trainer at every traced op
    decode vs prefill the engine's decode step against its own prefill at every traced op

`bitwise` passes where all three hold. For stacks that cannot be bitwise, the onboarding bars
other frameworks use: NeMo-RL's mean exp(|Δℓ|) over the sampled tokens at most 1.05, and
prime-rl's KL between the two at most 0.015 (k3, per token). The rule chosen decides the exit
status: 0 where it passes, 1 where it does not, 2 for bad input (every refusal's status).
Imports nothing heavy: the settings check the rule's name with it, and the audit
(parity/audit/command.py) judges its figures with it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # the config imports without torch (`parity --help` in a blink)
    import torch

from parity import metric_names as mn


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    passes: Callable[[dict[str, Any]], bool]   # on the certificate's figures


def _bitwise(c: dict[str, Any]) -> bool:
    return all(k["holds"] for k in c["checks"])


def _bar(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda c: c["bars"][name]["holds"]


NEMO_BAR, PRIME_BAR = 1.05, 0.015
RULES: dict[str, Rule] = {r.name: r for r in [
    Rule("bitwise", "the trainer and the engine agree to the bit: every check, every token "
                    "and traced op", _bitwise),
    Rule("nemo-rl", f"NeMo-RL's onboarding bar: mean exp(|Δℓ|) over the sampled tokens at most "
                    f"{NEMO_BAR}", _bar("nemo-rl")),
    Rule("prime-rl", f"prime-rl's bar: KL (k3) between the engine and the trainer at most "
                     f"{PRIME_BAR} per token", _bar("prime-rl")),
]}


def _first_nonzero(points: list[str], curve: dict[str, list] | None) -> tuple[str, float] | None:
    """The first point in forward order where the max relative error is not exactly 0 (or was
    not finite, or was not traced); None where every point agrees to the bit."""
    if curve is None:
        return ("(not traced)", math.nan)
    for p, mx, bad in zip(points, curve["max"], curve["non_finite"]):
        if bad or mx is None or mx != 0:
            return (p, math.nan if mx is None else mx)
    return None


def certificate(result: dict[str, Any], gap_max: float | None, log_exp_gap: float | None,
                rule: str) -> dict[str, Any]:
    """The checks and the bars from an audit's `result` (with `locate`), `gap_max` the largest
    |ℓ_π − ℓ_μ| over the sampled tokens and `log_exp_gap` the log of the mean of
    exp(|ℓ_π − ℓ_μ|) (None where no token was measured). The NeMo-RL bar is judged in log
    space; its `value` is the mean itself, or None where that is past float64's range, with
    `log_value` beside it."""
    loc = result["locate"]
    layers = loc.get("layers") or {}
    points, curves = layers.get("points", []), layers.get("curves", {})
    rows = [r for r in loc["self_gap"] if r["forward"] == "trainer"]
    checks = []
    worst = max((r for r in rows if r["abs_max"] is not None), key=lambda r: r["abs_max"],
                default=None)
    checks.append({"check": "trainer layouts",
                   "what": "the trainer at micro-batch 1 and N, padded left and right",
                   "holds": bool(rows) and all(r["tokens"] and r["abs_max"] == 0 for r in rows),
                   "at": worst["change"] if worst and worst["abs_max"] else None,
                   "value": worst["abs_max"] if worst else None})
    at = _first_nonzero(points, curves.get("engine"))
    checks.append({"check": "trainer vs engine",
                   "what": "the trainer against the engine's decode (every sampled token) and "
                           "its prefill (every traced op)",
                   "holds": gap_max == 0 and at is None,
                   # the op where the prefill first differs names the cause; the sampled
                   # tokens' largest |Δℓ| is what the ratio sees
                   "at": at[0] if at else ("sampled tokens' log-probs" if gap_max != 0 else None),
                   "value": at[1] if at else gap_max, "tokens_max": gap_max})
    at = _first_nonzero(points, curves.get("decode_vs_prefill"))
    checks.append({"check": "decode vs prefill",
                   "what": "the engine's decode step against its own prefill (every traced op)",
                   "holds": at is None, "at": at and at[0], "value": at and at[1]})
    kl = result["metrics"].get(mn.KL_K3)
    c = {"checks": checks,
         "bars": {"nemo-rl": {"value": _exp(log_exp_gap), "log_value": log_exp_gap,
                              "bar": NEMO_BAR, "holds": log_exp_gap is not None
                              and log_exp_gap <= math.log(NEMO_BAR)},
                  "prime-rl": {"value": kl, "bar": PRIME_BAR,
                               "holds": kl is not None and kl <= PRIME_BAR}},
         "rule": rule}
    c["holds"] = RULES[rule].passes(c)
    return c


def log_mean_exp(gap: torch.Tensor) -> float | None:
    """log mean exp(gap) in float64 without forming exp(gap), which overflows past 709."""
    import torch  # here: the config modules import without torch
    if not gap.numel():
        return None
    return float(torch.logsumexp(gap.double(), 0) - math.log(gap.numel()))


def _exp(x: float | None) -> float | None:
    return math.exp(x) if x is not None and x < math.log(sys.float_info.max) else None


def _bar_said(n: str, b: dict[str, Any]) -> str:
    said = "holds" if b["holds"] else "fails"
    if b["value"] is not None:
        return f"{n} {b['value']:.4g} against {b['bar']} ({said})"
    if b.get("log_value") is not None:
        return f"{n} e^{b['log_value']:.4g} against {b['bar']} ({said})"
    return f"{n} not measured"


def _said(k: dict[str, Any]) -> str:
    v = k["value"]
    by = f" by {v:.3g}" if isinstance(v, float) and math.isfinite(v) else ""
    t = k.get("tokens_max")
    if t and k["at"] != "sampled tokens' log-probs":
        by += f" (sampled tokens' |Δℓ| up to {t:.3g})"
    return f"{k['check']} holds" if k["holds"] else f"{k['check']} differs at {k['at']}{by}"


def line(c: dict[str, Any]) -> str:
    """One line: the rule's verdict, each check (where it differs, the first op and by how
    much), and the bars."""
    bits = ("bitwise: every check holds to the bit" if all(k["holds"] for k in c["checks"])
            else "not bitwise: " + ", ".join(_said(k) for k in c["checks"]))
    bars = "; ".join(_bar_said(n, b) for n, b in c["bars"].items())
    verdict = "passes" if c["holds"] else "fails"
    return f"certificate ({c['rule']}: {verdict}): {bits}; {bars}"
