"""The real model's claims (`parity reproduce --model`), judged as `parity.experiments.claims`
judges the testbed's. Training effects on the real model are judged on how far completions
shorten in a run (`drop`: mean length over its first steps minus over its last), compared
between recipes against the spread of seeds: a two-sided 95% interval from Student's t with the
pooled standard deviation, so two or three seeds give wide intervals rather than false verdicts.
"""

from __future__ import annotations

import math

from parity.experiments.claims import (
    HOLDS,
    NOT_AT_SCALE,
    NOT_MEASURABLE,
    SEED_PHANTOM,
    Claim,
    difference,
)


def _fmt(v: list[float]) -> str:
    return "[" + ", ".join(f"{x:.1f}" for x in v) + "]"


def real_gap(beta_abs: float, phantom_02: float, model: str) -> Claim:
    """R1. On real weights a bf16 engine's per-token gap is 1e-2..1e-1 and phantom-clips a large
    share of tokens at ε = 0.2 (the seeds' 18%); within a factor 3 counts as the same."""
    m = {"beta_abs_mean": beta_abs, "phantom_frac_eps_0.2": phantom_02}
    s = f"{model}: |β| is 1e-2..1e-1 per token and ~18% of tokens are phantom-clipped at ε = 0.2"
    seeds = f"|β| 1e-2..1e-1, {SEED_PHANTOM:.0%} phantom-clipped (Qwen3-0.6B)"
    in_range = 1e-2 <= beta_abs <= 1e-1
    near = SEED_PHANTOM / 3 <= phantom_02 <= SEED_PHANTOM * 3
    detail = f"|β| = {beta_abs:.3g}, {phantom_02:.2%} phantom-clipped at ε = 0.2"
    if in_range and near:
        return Claim(id="R1", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    why = [] if in_range else ["|β| outside 1e-2..1e-1"]
    why += [] if near else ["the phantom share is outside a factor 3 of 18%"]
    return Claim(id="R1", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"{detail}: {'; '.join(why)}")


def fp32_head_helps(kl_bf16: float, kl_head: float, beta_bf16: float, beta_head: float,
                    min_ratio: float = 2.0) -> Claim:
    """R3. Computing the LM head in fp32 on both sides (MiniMax-M1's fix; TRL's
    `cast_lm_head_to_fp32`) shrinks the bf16 gap: KL at least `min_ratio` times lower."""
    ratio = kl_bf16 / kl_head if kl_head > 0 else math.inf
    m = {"kl_bf16": kl_bf16, "kl_bf16_fp32_head": kl_head, "kl_ratio": ratio,
         "beta_abs_bf16": beta_bf16, "beta_abs_bf16_fp32_head": beta_head}
    s = "an fp32 LM head shrinks the bf16 engine's gap"
    seeds = "MiniMax-M1: fp32 LM head lifts the train/inference probability correlation"
    detail = (f"KL {kl_bf16:.2g} → {kl_head:.2g} ({ratio:.2g}× lower), |β| {beta_bf16:.3g} → "
              f"{beta_head:.3g}")
    if ratio >= min_ratio:
        return Claim(id="R3", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    return Claim(id="R3", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"{detail}: less than {min_ratio:g}× (the rest of the network's bf16 "
                        f"arithmetic dominates)")


def sanity_check(drops: dict[str, list[float]], lr: float, steps: int) -> Claim:
    """R4. The seed's sanity check: at ε = 0.2 and lr 1e-6 the bf16 engine stalls or lags
    against fp32 (its completions shorten less)."""
    fp32, bf16 = drops.get("fp32", []), drops.get("bf16-engine", [])
    d = difference(bf16, fp32)
    m = {"lr": lr, "steps": steps, "drop_fp32": fp32, "drop_bf16_engine": bf16,
         "difference": d[0] if d else None, "interval_95": d[1] if d else None}
    s = f"neg-length-chat at ε = 0.2, lr {lr:g}: bf16-engine stalls or lags against fp32"
    seeds = "GRPO with a bf16 engine stalls or collapses; fp32/fp16 train"
    if d is None:
        return Claim(id="R4", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="fewer than two finished seeds of fp32 or bf16-engine")
    detail = (f"length drop over {steps} steps, per seed: bf16-engine {_fmt(bf16)}, fp32 "
              f"{_fmt(fp32)}; difference {d[0]:+.1f} ± {d[1]:.1f} tokens (95%)")
    if d[0] < -d[1]:
        return Claim(id="R4", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=f"bf16-engine lags: {detail}")
    if d[0] > d[1]:
        return Claim(id="R4", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                     reason=f"the opposite: bf16-engine shortens completions faster than fp32: "
                            f"{detail}")
    return Claim(id="R4", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                 reason=f"within the seed spread: {detail}")


def _like(x: float, a: list[float], b: list[float]) -> str:
    """Whether one run's drop `x` falls nearer the runs `a` (fp32) or `b` (bf16-engine), in
    units of their pooled spread; 'between' when it is not clearly nearer one of them."""
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    if abs(ma - mb) < 1e-9:
        return "between"
    t = (x - ma) / (mb - ma)          # 0 at fp32's mean, 1 at bf16-engine's
    return "like fp32" if t < 0.25 else "like bf16-engine" if t > 0.75 else "between"


def fixes_on_real_model(drops: dict[str, list[float]], lag: Claim) -> Claim:
    """R5. bf16-shadow, no-clip and recompute restore fp32's training where bf16-engine lags.
    Where it does not lag, says which side each fix falls on (one seed each): a fix that moves
    like bf16-engine although it removes β from the ratio (bf16-shadow) shows the difference
    comes from the engine's sampling policy, not from the ratio."""
    fixes = [r for r in ("bf16-shadow", "no-clip", "recompute") if drops.get(r)]
    fp32, bf16 = drops.get("fp32", []), drops.get("bf16-engine", [])
    m = {f"drop_{r}": drops.get(r) for r in ("bf16-shadow", "no-clip", "recompute")}
    s = "bf16-shadow, no-clip and recompute restore fp32's training"
    seeds = "removing β from the ratio, or the clip, restores convergence"
    if len(fixes) < 3 or not fp32 or not bf16:
        return Claim(id="R5", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="a recipe's runs are missing")
    sides = {r: _like(sum(drops[r]) / len(drops[r]), fp32, bf16) for r in fixes}
    m["sides"] = sides
    detail = ", ".join(f"{r} {_fmt(drops[r])} ({sides[r]})" for r in fixes)
    if lag.verdict != HOLDS:
        return Claim(id="R5", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason=f"bf16-engine does not lag, so there is nothing to restore: {detail}")
    if all(v == "like fp32" for v in sides.values()):
        return Claim(id="R5", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    return Claim(id="R5", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=detail)


def scored_shadow_like_fp32(drops: dict[str, list[float]]) -> Claim:
    """R5s. bf16-shadow with the shadow the engine scores itself (`shadow_kernels=scored`, the
    recipe named bf16-shadow-scored here) trains like fp32 where bf16-engine lags: its drop
    differs from bf16-engine's beyond the 95% interval, toward fp32's, and not from fp32's. A
    shadow parity computes would carry its kernels' gap to the engine into the ratio; the
    engine's own scores do not."""
    fp32, bf16, sc = (drops.get(r, []) for r in ("fp32", "bf16-engine", "bf16-shadow-scored"))
    d_bf, d_sc_bf, d_sc_fp = difference(bf16, fp32), difference(sc, bf16), difference(sc, fp32)
    m = {"drop_bf16_shadow_scored": sc,
         "scored_minus_bf16_engine": d_sc_bf[0] if d_sc_bf else None,
         "interval_95_bf16_engine": d_sc_bf[1] if d_sc_bf else None,
         "scored_minus_fp32": d_sc_fp[0] if d_sc_fp else None,
         "interval_95_fp32": d_sc_fp[1] if d_sc_fp else None}
    s = "bf16-shadow with the engine-scored shadow trains like fp32"
    seeds = "removing β from the ratio restores convergence (a shadow in engine precision)"
    if d_bf is None or d_sc_bf is None or d_sc_fp is None:
        return Claim(id="R5s", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="fewer than two seeds of a recipe")
    detail = (f"bf16-shadow-scored {_fmt(sc)}: {d_sc_bf[0]:+.1f} ± {d_sc_bf[1]:.1f} against "
              f"bf16-engine {_fmt(bf16)}, {d_sc_fp[0]:+.1f} ± {d_sc_fp[1]:.1f} against fp32 "
              f"{_fmt(fp32)} (95%)")
    if not d_bf[0] < -d_bf[1]:
        return Claim(id="R5s", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason=f"bf16-engine does not lag fp32 beyond the seed spread "
                            f"({d_bf[0]:+.1f} ± {d_bf[1]:.1f}), so there is nothing to restore: "
                            f"{detail}")
    # bf16-engine lags: fp32 shortens completions more, so toward fp32 is a larger drop.
    away = d_sc_bf[0] > d_sc_bf[1]
    like = abs(d_sc_fp[0]) <= d_sc_fp[1]
    if away and like:
        return Claim(id="R5s", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    why = [] if away else ["it does not differ from bf16-engine toward fp32"]
    why += [] if like else ["it differs from fp32"]
    return Claim(id="R5s", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"{'; '.join(why)}: {detail}")


def fp16_like_fp32(drops: dict[str, list[float]]) -> Claim:
    """R6. The FP16 paper's headline: an fp16 engine and trainer train as fp32 does, where bf16
    does not. Measurable only where bf16-engine differs from fp32."""
    fp32, bf16, fp16 = (drops.get(r, []) for r in ("fp32", "bf16-engine", "fp16"))
    d_bf, d_f16 = difference(bf16, fp32), difference(fp16, fp32)
    m = {"drop_fp16": fp16, "fp16_minus_fp32": d_f16[0] if d_f16 else None,
         "interval_95": d_f16[1] if d_f16 else None}
    s = "fp16 trains as fp32 does, where bf16 does not"
    seeds = "FP16 paper: every algorithm reaches ~0.97 in fp16; bf16 GRPO collapses"
    if d_bf is None or d_f16 is None:
        return Claim(id="R6", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="fewer than two seeds of a recipe")
    detail = (f"fp16 {_fmt(fp16)} against fp32 {_fmt(fp32)}: {d_f16[0]:+.1f} ± {d_f16[1]:.1f}; "
              f"bf16-engine {d_bf[0]:+.1f} ± {d_bf[1]:.1f}")
    if abs(d_bf[0]) <= d_bf[1]:
        return Claim(id="R6", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason=f"bf16-engine does not differ from fp32 beyond the seed spread: "
                            f"{detail}")
    if abs(d_f16[0]) <= d_f16[1]:
        return Claim(id="R6", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    return Claim(id="R6", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"fp16 differs from fp32 too: {detail}")


def gap_grows(first: list[float], last: list[float], what: str, cid: str) -> Claim:
    """R7. The bf16 mismatch grows during training: every seed's mean over its last steps
    exceeds its first step's value by more than 20%."""
    m = {"first_step": first, "last_steps": last}
    s = f"the bf16 engine's {what} grows during training"
    seeds = "users of the FP16 paper's code ask why the bf16 mismatch KL grows in training"
    if not first or len(first) != len(last):
        return Claim(id=cid, statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="no finished bf16-engine run")
    pairs = ", ".join(f"{a:.3g} → {b:.3g}" for a, b in zip(first, last))
    if all(b > 1.2 * a for a, b in zip(first, last)):
        return Claim(id=cid, statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=f"first step → last steps, per seed: {pairs}")
    return Claim(id=cid, statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=f"not in every seed: {pairs}")


def ties_make_the_gap_grow(ties: float | None, first_sync: dict[str, float | None],
                          growth: dict[str, list[float]]) -> Claim:
    """R8. parity's own explanation of a bf16 mismatch that grows in training, from dequantised
    weights: a weight exactly halfway between two bf16 values flips at the first sync however
    small the update, each by a whole bf16 step in the update's direction (on SmolLM2-135M the
    median step at its ties is 2.4e-4, against Adam's step of about lr = 1e-6), so the engine's
    policy moves coherently away from the trainer's. The growth is the mean KL(μ‖π) after the
    first sync over the KL at step 1. Holds when every run on the dequantised weights grows by
    more than 2×, every run on the same weights rounded to bf16 (no ties) by less than 1.5×, and
    the first sync flips at least 5× more weights on the dequantised ones."""
    deq, rnd = first_sync.get("dequantised"), first_sync.get("bf16-rounded")
    g_deq, g_rnd = growth.get("dequantised", []), growth.get("bf16-rounded", [])
    m = {"dequantised_bf16_ties": ties, "first_sync_changed": first_sync, "kl_growth": growth}
    s = ("the bf16 mismatch grows after the first sync because dequantised weights sit on bf16 "
         "ties")
    seeds = "(parity's own explanation of the growth users of the FP16 paper's code ask about)"
    if not g_deq or not g_rnd or deq is None or rnd is None or ties is None:
        return Claim(id="R8", statement=s, seeds=seeds, measured=m, verdict=NOT_MEASURABLE,
                     reason="a bf16-engine run of the dequantised or the bf16-rounded weights is "
                            "missing")
    detail = (f"{ties:.1%} of the dequantised weights are bf16 ties; the first sync changes "
              f"{deq:.2%} of the engine's bf16 weights there and {rnd:.2%} on the bf16-rounded "
              f"copy; KL after the first sync / KL at step 1, per seed: dequantised "
              f"{', '.join(f'{x:.1f}×' for x in g_deq)}, bf16-rounded "
              f"{', '.join(f'{x:.1f}×' for x in g_rnd)}")
    if min(g_deq) > 2 and max(g_rnd) < 1.5 and deq > 5 * rnd:
        return Claim(id="R8", statement=s, seeds=seeds, measured=m, verdict=HOLDS,
                     reason=detail)
    return Claim(id="R8", statement=s, seeds=seeds, measured=m, verdict=NOT_AT_SCALE,
                 reason=detail)
