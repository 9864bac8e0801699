"""A step's metrics (their names: docs/design.md), from what each rank saw of the step.

One process is the case of one rank. Across ranks, the per-token diagnostics are pooled before
they are summarised and the rewards are concatenated, so the metrics equal the one-process
figures; the few per-rank statistics that arrive already summarised (importance weights,
value and DPO figures) are combined as weighted means, with extremes by max/min.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from parity import metric_names as mn
from parity.config import Config
from parity.diagnostics import StepDiagnostics
from parity.objectives import OBJECTIVES


def json_safe(m: dict[str, Any]) -> dict[str, Any]:
    """Non-finite values (the gradient norm of a skipped fp16 update) as null: NaN is not JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: sum(d[k] for d in ds if k in d) / sum(k in d for d in ds) for k in sorted(keys)}


def _reduce(dicts: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    """Ranks' metric dicts as one: extremes by max/min, counts summed, the rest weighted means."""
    out = {}
    for k in sorted({k for d in dicts for k in d}):
        vals = [(d[k], w) for d, w in zip(dicts, weights) if k in d]
        words = set(k.replace("/", "_").split("_"))   # is/weight_max_raw -> {..., "max", ...}
        if "max" in words:
            out[k] = max(v for v, _ in vals)
        elif "min" in words:
            out[k] = min(v for v, _ in vals)
        elif k == mn.DPO_PAIRS:
            out[k] = sum(v for v, _ in vals)
        else:
            total = sum(w for _, w in vals)
            out[k] = (sum(v * w for v, w in vals) / total if total
                      else sum(v for v, _ in vals) / len(vals))
    return out


@dataclass(kw_only=True)
class StepPart:
    """What one rank saw of a step; rank 0 turns all ranks' parts into the step's metrics."""
    rewards: list[float]
    parts: dict[str, list[float]]
    n_tok: float
    finished: int
    diag: StepDiagnostics
    prep: dict[str, float]
    extras: dict[str, float]
    policy_loss: float         # the mean over this rank's updates of the policy loss
    times: dict[str, float]
    dump: list = field(default_factory=list)


def step_metrics(parts: list[StepPart], cfg: Config) -> dict[str, Any]:
    rewards = torch.tensor([x for p in parts for x in p.rewards], device="cpu")
    names = list(parts[0].parts)
    n_tok = sum(p.n_tok for p in parts)
    tok_w = [p.n_tok for p in parts]
    pairs_w = [p.extras.get(mn.DPO_PAIRS, 1.0) for p in parts]
    obj = OBJECTIVES[cfg.objective]
    # per-token statistics weigh by tokens, per-sequence ones by rows, DPO's by pairs
    prep_w = (tok_w if cfg.correction.startswith("token") or obj.value_head
              else [1.0] * len(parts))
    times = {k: max(p.times[k] for p in parts) for k in parts[0].times}
    return {
        mn.REWARD_MEAN: float(rewards.mean()),
        mn.REWARD_STD: float(rewards.std()) if len(rewards) > 1 else 0.0,
        # each function's own mean, unweighted, when there are several (TRL's names)
        **({mn.REWARD_FN_MEAN.format(fn=k):
            sum(x for p in parts for x in p.parts[k]) / len(rewards)
            for k in names} if len(names) > 1 else {}),
        mn.LEN_MEAN: n_tok / len(rewards),
        mn.EOS_FRAC: sum(p.finished for p in parts) / len(rewards),
        **StepDiagnostics.merge([p.diag for p in parts]).metrics(),
        **_reduce([p.prep for p in parts], prep_w),
        **_reduce([p.extras for p in parts], pairs_w if obj.pairs
                  else [1.0] * len(parts)),
        mn.LOSS_POLICY: sum(p.policy_loss for p in parts) / len(parts),
        **times,
        mn.TOKENS_PER_S: n_tok / times[mn.STEP_S],
    }
