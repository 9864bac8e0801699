"""What `parity audit --locate` names: the op where the engine's kernels matter, and what to do.

The yardstick at each traced point is precision alone: the trainer's own model in the engine's
dtype against the trainer (docs/diagnostics.md, "Where the gap comes from"). The engine's
kernels matter at the first point where its error against the trainer rises above that
yardstick by `RISE`:

    ratio(p) = median_t e_t(p) / max(median_t q_t(p), FLOOR)

with e_t the engine's relative error at token t and q_t precision's, and its uncertainty over
tokens a bootstrap of the same ratio (`BOOT` resamples of the tokens, a fixed seed): a point
rises where the interval's lower end (`LOW`) is above `RISE`. The first point where the two
differ at all in their last bits stays a detail: on a GPU that is the first norm nearly always.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from parity.models import trace as tr

# The engine's error must be at least twice precision's (a second rounding of the same size
# gives about √2).
RISE = 2.0
# A relative error of 1e-4 is a fifth of fp16's unit roundoff (4.9e-4) and far under bf16's
# (3.9e-3): below it no op is named; fp32 kernels that sum in another order part far below it
# (tests/test_locate_finding.py, fp32 on both sides).
FLOOR = 1e-4
BOOT = 200
LOW = 0.05   # the interval's lower quantile


def rise(e: torch.Tensor, q: torch.Tensor) -> dict[str, float] | None:
    """The ratio of medians of the engine's errors `e` to precision's `q` (the same tokens) and
    its bootstrap lower end; None where no token has both. An error that overflowed (inf, NaN)
    where precision's did not counts as infinite."""
    e = torch.where(torch.isfinite(e), e, torch.full_like(e, math.inf)).double()
    ok = torch.isfinite(q)
    e, q = e[ok], q[ok].double()
    if not e.numel():
        return None
    ratio = float(e.median() / q.median().clamp(min=FLOOR))
    low = ratio
    if ratio > RISE and e.numel() > 1:
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(e.numel(), (BOOT, e.numel()), generator=g)
        boot = e[idx].median(1).values / q[idx].median(1).values.clamp(min=FLOOR)
        low = float(torch.quantile(boot, LOW))
    return {"ratio": ratio, "low": low}


def first_rise(points: list[str], errs: dict[str, torch.Tensor], yard: dict[str, torch.Tensor]
               ) -> tuple[str, dict[str, float]] | None:
    """The first point, in forward order, where `errs` rises above `yard` by RISE."""
    for p in points:
        if p in errs and p in yard and errs[p].shape == yard[p].shape:
            r = rise(errs[p], yard[p])
            if r is not None and r["low"] > RISE:
                return p, r
    return None


# What a finding at each kind of op suggests (docs/diagnostics.md, Where the gap comes from).
SUGGEST = {"embedding": "the engine's embedding differs: check that it holds the trainer's "
                        "weights (a sync that did not reach it)",
           "norm": "match the norm's casts: normalise in fp32, cast to the weight's dtype, then "
                   "multiply by the weight, as transformers does",
           "matmul": "the same matmul kernels at the same shapes on both sides (batch-invariant "
                     "kernels, the same tensor-parallel degree, the same fusion of projections)",
           "RoPE": "RoPE's angles and rotation in fp32 on both sides, from the same table",
           "attention kernel": "the same attention kernel and split of the keys on both sides "
                               "(or the engine scores the shadow: --shadow-kernels scored)",
           "activation": "the activation in the same dtype and formula on both sides (vLLM "
                         "fuses SiLU and the product)",
           "residual add": "the residual add in the same dtype on both sides (vLLM fuses it into "
                           "the next norm)",
           "head": "an fp32 LM head on both sides (--lm-head-fp32 for parity's engine)",
           "router": "train on the engine's experts (--routing-replay, Rollout Routing Replay; "
                     "docs/moe.md), or the router's logits in fp32 with the same kernel on both "
                     "sides"}
PRECISION = ("precision is the cause: fp16 on both sides, or a recipe that takes β out of the "
             "ratio (bf16-shadow)")


def _g(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2g}"


def finding(loc: dict[str, Any], engine: str, engine_dtype: str, trainer_dtype: str) -> str:
    """The one-line finding from `locate`'s result."""
    curves, named = loc["curves"], loc.get("named")
    if "engine" not in curves:
        return (f"the engine was not traced ({engine}): only the precision curve, "
                f"{engine_dtype} against {trainer_dtype}, is shown")
    points, missing = loc["points"], loc["missing"].get("engine", [])
    if len(missing) == len(points):
        return f"{engine}'s trace held none of the trainer's points: nothing is claimed"
    logits = loc["logits"]
    at = ""
    if "engine" in logits and "precision" in logits:
        e, p = logits["engine"], logits["precision"]
        at = (f"; at the logits the sampled tokens' mean |Δℓ| is {_g(e['abs_dlogp_mean'])} "
              f"(precision alone {_g(p['abs_dlogp_mean'])}), KL {_g(e['kl_mean'])}")
    if named is not None and "flip_frac" in named:
        where = (" over the sampled completions' decode" if named["pass"] == "sampled decode"
                 else " in the traced sequences")
        return (f"{engine}'s routing parts from the trainer's from "
                f"{tr.describe(named['point'])}: {named['flip_frac']:.2%} of its decisions "
                f"flipped{where} (other experts than the trainer's top {named['top_k']}), ahead "
                f"of any kernel{at}")
    if named is not None:
        when = " in its decode steps" if named["pass"] == "decode" else ""
        i = points.index(named["point"])
        c = curves["decode" if named["pass"] == "decode" else "engine"]
        q = curves["precision_last" if named["pass"] == "decode" else "precision"]
        return (f"{engine}'s kernels matter{when} from {tr.describe(named['point'])} "
                f"({named['op']}): median relative error {_g(c['median'][i])} against "
                f"{_g(q['median'][i])} for {engine_dtype} alone, {named['ratio']:.3g}x (95% "
                f"of resamples above {named['low']:.3g}x){at}")
    untraced = (f" ({len(missing)} of {len(points)} points not traced, nothing claimed there)"
                if missing else "")
    if _within_floor(loc):
        return (f"{engine} in {engine_dtype} stays within {FLOOR:g} of the {trainer_dtype} "
                f"trainer at every traced point{untraced}: no op of the engine's is a cause{at}")
    return (f"nothing in {engine}'s forward rises above {engine_dtype} precision by {RISE:g}x at "
            f"any traced point{untraced}: the gap is precision{at}")


def _within_floor(loc: dict[str, Any]) -> bool:
    """The engine's median error against the trainer is under FLOOR at every traced point
    (fp32 on both sides): there is no gap to place."""
    med = [v for v in loc["curves"]["engine"]["median"] if v is not None]
    return bool(med) and max(med) < FLOOR


def details(loc: dict[str, Any]) -> list[str]:
    """The finding's detail lines: the first bit-level difference, what was not traced."""
    out = [f"flipped router decisions by layer, {what}: " + ", ".join(
        f"{layer} {share:.2%}" for layer, share in loc[key].items())
        for key, what in (("router_flips_sampled", "sampled completions (decode)"),
                          ("router_flips", "traced sequences (prefill)")) if loc.get(key)]
    first = loc.get("first_difference")
    if first:
        out.append(f"first bit-level difference from the trainer's own {loc['engine_dtype']} "
                   f"forward: {tr.describe(first)} ({tr.kind(first)})")
    for c, v in loc.get("logits", {}).items():
        if v.get("left_out"):
            out.append(f"at the logits ({c}): {v['left_out']} positions whose logits are not "
                       f"finite, left out")
    for c, pts in loc["missing"].items():
        if pts:
            shown = ", ".join(pts[:6]) + (f" and {len(pts) - 6} more" if len(pts) > 6 else "")
            out.append(f"not traced ({c}): {shown}")
    return out


def advice(loc: dict[str, Any]) -> str | None:
    """The advice's line for where the engine parts, or that precision is the cause."""
    named = loc.get("named")
    if named:
        when = " in decode steps" if named["pass"] == "decode" else ""
        return (f"where the engine's kernels matter{when}: {tr.describe(named['point'])} "
                f"({named['op']}); {SUGGEST[named['op']]}")
    if "engine" in loc.get("curves", {}) and not _within_floor(loc) and \
            len(loc["missing"].get("engine", [])) < len(loc["points"]):
        return f"no op of the engine's rises above precision: {PRECISION}"
    return None
