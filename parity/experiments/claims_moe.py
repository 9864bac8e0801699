"""The mixture-of-experts claim, judged from two measured runs (parity/experiments/claims.py's
verdicts and form): Rollout Routing Replay closes the gap the routing flips open."""

from __future__ import annotations

from typing import Any

from parity import metric_names as mn
from parity.experiments.claims import HOLDS, NOT_AT_SCALE, NOT_MEASURABLE, Claim

# Under replay a flipped token keeps at most this many times the others' |β|; without it, the
# flips must carry at least FLIPS_CARRY times the others', or there is no routing gap to close.
REPLAY_LEFT = 1.5
FLIPS_CARRY = 2.0
# A mean |β| over fewer flipped tokens than this is one or two tokens' luck, not a gap.
MIN_FLIPPED = 10


def replay_closes_the_routing_gap(free: dict[str, Any] | None, replayed: dict[str, Any] | None,
                                  model: str, completions: int) -> Claim:
    """12. A bf16 engine's routing flips give the tokens they touch a gap far above the others';
    routing the trainer as the engine did (R3) brings those tokens to the others' gap. `free`
    and `replayed`: step 1 of a run without and with `--routing-replay` on one seed (the same
    rollout), None where a run failed; `completions` the step's count, which with its mean
    length gives the sampled tokens."""
    keys = (mn.ROUTING_FLIP_FRAC, mn.ROUTING_TOKEN_FLIP_FRAC, mn.ROUTING_BETA_ABS_FLIPPED,
            mn.ROUTING_BETA_ABS_UNFLIPPED)
    m = {"model": model, **{f"{k}{suffix}": (run or {}).get(k) for run, suffix in
                            ((free, ""), (replayed, " (replay)")) for k in keys}}
    if free is not None:
        m["flipped_tokens"] = round(free.get(mn.ROUTING_TOKEN_FLIP_FRAC, 0.0)
                                    * free.get(mn.LEN_MEAN, 0.0) * completions)
    s = "routing replay brings the tokens whose routing flipped to the others' gap"
    seeds = "R3: replaying the engine's experts removes the routing share of the mismatch"
    if free is None or replayed is None:
        return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="a run of the mixture of experts failed (its error is in the "
                            "sweep's summary.json)")
    flipped, rest = free.get(mn.ROUTING_BETA_ABS_FLIPPED), free.get(mn.ROUTING_BETA_ABS_UNFLIPPED)
    after = replayed.get(mn.ROUTING_BETA_ABS_FLIPPED)
    after_rest = replayed.get(mn.ROUTING_BETA_ABS_UNFLIPPED)
    if flipped is None or rest is None or after is None or after_rest is None:
        return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason=f"no sampled token's routing flipped on {model} "
                            f"({free.get(mn.ROUTING_FLIP_FRAC, 0):.2%} of decisions), so there "
                            f"is no flipped token's gap to compare")
    if m["flipped_tokens"] < MIN_FLIPPED:
        return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason=f"{m['flipped_tokens']} sampled tokens' routing flipped on {model}; "
                            f"a mean over fewer than {MIN_FLIPPED} is no gap")
    if flipped < FLIPS_CARRY * rest:
        return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                     reason=f"the flipped tokens' |β| ({flipped:.3g}) is not {FLIPS_CARRY:g}x "
                            f"the others' ({rest:.3g}): the flips open no gap here to close")
    if after <= REPLAY_LEFT * after_rest:
        return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=f"flipped tokens' |β| {flipped:.3g} against {rest:.3g} for the others; "
                            f"with replay {after:.3g} against {after_rest:.3g}")
    return Claim(id="12", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"with replay the flipped tokens keep |β| {after:.3g}, more than "
                        f"{REPLAY_LEFT:g}x the others' {after_rest:.3g}")
