"""Every figure parity logs is finite for finite log-probs, however far apart: generated batches
with gaps of up to 1.01e4 nats either way, tokens at e^-80 and far below, ties, masks of every
dtype and anything at all (NaN, inf, 3.4e38) where the mask is 0; where asked, NaN, inf or a
positive value, no log-prob, on a valid token too. The exact figures equal a
float64 reference computed here by hand; the estimators that exponentiate a log-ratio (k3, the
importance weights) are bounded as docs/diagnostics.md says. The same property holds for each
place that builds figures: `measure` itself, the trainer's step metrics, both TRL trainers'
functions, the verl plugin's and the audit's Measurement (those of TRL and verl import them, so
they are end to end)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity import metric_names as mn
from parity.diagnostics import StepDiagnostics, measure
from parity.runs.finite import LeftOut

# Deterministic (the same examples on every run) and about a second each; the coverage test
# below checks that 100 examples still reach the extremes.
SETTINGS = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
F32 = dict(width=32, allow_nan=False, allow_infinity=False)
FAR = -1.01e4
# A log-prob: an ordinary one, down to e^-100; one far below (a rare token, or a placeholder
# such as -1e4), so that two of them are up to 1.01e4 nats apart; or one of the edges: certain,
# e^-80 (the exact KL's floor), e^-104 (0 in float32).
LOGP = st.one_of(st.floats(-100.0, 0.0, **F32), st.floats(FAR, -100.0, **F32),
                 st.sampled_from([0.0, -80.0, -104.0, -1e4, FAR]))
GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 1e30, 7.0])
# What a valid token may hold that no log-prob is: NaN or inf, or a positive value (logits).
UNUSABLE = st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 9.0])
CLIP_RANGES = [(0.2, 0.2), (0.2, 0.28), (0.0013, 0.0013), (None, None)]
# The log-ratio above which exp(Δ) is taken at Δ = 80 (docs/diagnostics.md).
CAP = 80.0


@dataclass
class Batch:
    """[B][T] lists of float32 values: ℓ_π, ℓ_s, ℓ_μ, ℓ_old; `valid` the mask; for each of
    them, `junk` what it holds instead where the mask is 0 and `bad` a NaN, an inf or a
    positive value it holds instead on a valid token, {(row, position): value}."""
    pi: list
    s: list
    mu: list
    old: list
    valid: list
    junk: dict
    bad: dict
    adv: list
    eps: tuple
    sequence: bool

    @property
    def rows(self) -> int:
        return len(self.valid)

    def tensor(self, name: str, dtype=torch.float32, junk: bool = True) -> torch.Tensor:
        """The values, with those of `bad`, and `junk` under mask 0 unless not."""
        x = torch.tensor(getattr(self, name), dtype=torch.float64)
        for (i, t), v in {**self.bad[name], **(self.junk[name] if junk else {})}.items():
            x[i, t] = v
        return x.to(dtype)

    def mask(self, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(self.valid).to(dtype)


def _near(draw, base: float) -> float:
    """Another side's log-prob of a token: the same (a tie), a little off, or anything."""
    kind = draw(st.sampled_from(["tie", "near", "any"]))
    if kind == "tie":
        return base
    if kind == "near":
        return min(0.0, base + draw(st.floats(-0.5, 0.5, **F32)))
    return draw(LOGP)


@st.composite
def batches(draw, unusable: tuple[str, ...] = (), completions: bool = False) -> Batch:
    """A batch; with `unusable`, those sides may hold NaN, inf or a positive value on valid
    tokens too;
    `completions`: every row has a valid first token, as each completion of a rollout does."""
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    sides = {k: [[0.0] * T for _ in range(B)] for k in ("pi", "s", "mu", "old")}
    valid = [[(t == 0 and completions) or draw(st.booleans()) for t in range(T)]
             for _ in range(B)]
    junk: dict = {k: {} for k in sides}
    bad: dict = {k: {} for k in sides}
    for i in range(B):
        for t in range(T):
            base = draw(LOGP)
            for k in sides:
                sides[k][i][t] = float(torch.tensor(_near(draw, base), dtype=torch.float32))
                if not valid[i][t] and draw(st.booleans()):
                    junk[k][i, t] = draw(GARBAGE)
                elif valid[i][t] and k in unusable and draw(st.integers(0, 5)) == 0:
                    bad[k][i, t] = draw(UNUSABLE)
    adv = [draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0, **F32))) for _ in range(B)]
    return Batch(**sides, valid=valid, junk=junk, bad=bad, adv=adv,
                 eps=draw(st.sampled_from(CLIP_RANGES)), sequence=draw(st.booleans()))


# ---- the float64 reference, by hand ------------------------------------------------------

def _clip(x: float, a: float, eps: tuple) -> bool:
    lo, hi = eps
    return ((a > 0 and hi is not None and x > math.log1p(hi))
            or (a < 0 and lo is not None and x < math.log1p(-lo)))


def _k3(d: float) -> float:
    d = min(d, CAP)
    return math.exp(d) - d - 1


def reference(b: Batch, source: str = "engine", checked: tuple[str, ...] = ("pi", "s", "mu"),
              rows: list[int] | None = None) -> tuple[dict, dict, LeftOut]:
    """The figures docs/design.md defines, in float64 from the batch's values, over its valid
    tokens whose `checked` sides hold no `bad` value (the rest are left out); `rows`: the rows
    that exist (all by default). Returns (figures, the scale each one's rounding is relative
    to, the tokens left out: non-finite where any side is, else positive)."""
    rows = list(range(b.rows)) if rows is None else rows
    kept, left = [], LeftOut()
    for i in rows:
        for t, v in enumerate(b.valid[i]):
            if not v:
                continue
            held = [b.bad[k][i, t] for k in checked if (i, t) in b.bad[k]]
            if any(not math.isfinite(x) for x in held):
                left += LeftOut(non_finite=1)
            elif held:
                left += LeftOut(positive=1, largest=max(held))
            else:
                kept.append((i, t))
    val = lambda k: [getattr(b, k)[i][t] for i, t in kept]
    pi, s, mu, old = val("pi"), val("s"), val("mu"), val("old")
    ratio = {"engine": lambda j: pi[j] - mu[j], "shadow": lambda j: s[j] - mu[j],
             "recompute": lambda j: pi[j] - old[j]}[source]
    n = len(kept)
    alpha = [s[j] - mu[j] for j in range(n)]
    beta = [pi[j] - s[j] for j in range(n)]
    gap = [pi[j] - mu[j] for j in range(n)]
    log_r = [ratio(j) for j in range(n)]
    if b.sequence:   # each row judged on its tokens' mean log-ratio and mean α
        def by_row(x):
            out = {}
            for i in rows:
                mine = [x[j] for j, (r, _) in enumerate(kept) if r == i]
                out[i] = sum(mine) / len(mine) if mine else 0.0
            return out
        lr, al = by_row(log_r), by_row(alpha)
        judge_r = [lr[i] for i, _ in kept]
        judge_a = [al[i] for i, _ in kept]
    else:
        judge_r, judge_a = log_r, alpha
    adv = [b.adv[i] for i, _ in kept]
    c = [_clip(judge_r[j], adv[j], b.eps) for j in range(n)]
    ca = [_clip(judge_a[j], adv[j], b.eps) for j in range(n)]
    f, scale = {}, {}
    mean = lambda x: sum(x) / len(x)
    if n:
        for name, v in ((mn.CLIP_FRAC, c), (mn.PHANTOM_FRAC, [x and not y for x, y in zip(c, ca)]),
                        (mn.HIDDEN_FRAC, [y and not x for x, y in zip(c, ca)]),
                        (mn.ALPHA_CLIP_FRAC, ca)):
            f[name], scale[name] = sum(v) / n, 0.0
        absa, absb, absg = [abs(x) for x in alpha], [abs(x) for x in beta], [abs(x) for x in gap]
        f[mn.ALPHA_MEAN], scale[mn.ALPHA_MEAN] = mean(alpha), mean(absa)
        f[mn.ALPHA_ABS_MEAN] = f[mn.KERNEL_GAP_ABS_MEAN] = mean(absa)
        scale[mn.ALPHA_ABS_MEAN] = scale[mn.KERNEL_GAP_ABS_MEAN] = mean(absa)
        f[mn.BETA_MEAN], scale[mn.BETA_MEAN] = mean(beta), mean(absb)
        f[mn.BETA_ABS_MEAN], scale[mn.BETA_ABS_MEAN] = mean(absb), mean(absb)
        f[mn.BETA_ABS_MAX], scale[mn.BETA_ABS_MAX] = max(absb), max(absb)
        m = mean(beta)
        f[mn.BETA_STD] = math.sqrt(sum((x - m) ** 2 for x in beta) / (n - 1)) if n > 1 else 0.0
        scale[mn.BETA_STD] = 2 * max(absb)
        f[mn.KL_K1], scale[mn.KL_K1] = mean([-x for x in gap]), mean(absg)
        f[mn.KL_K3] = mean([_k3(x) for x in gap])
        # exp(Δ) of a Δ rounded to float32 (relative 6e-8) moves by |Δ| times as much
        scale[mn.KL_K3] = mean([math.exp(min(x, CAP)) * (1 + abs(x)) + abs(x) for x in gap])
        pdiff = [math.exp(pi[j]) - math.exp(mu[j]) for j in range(n)]
        f[mn.PROB_DIFF_ABS_MEAN] = mean([abs(x) for x in pdiff])
        f[mn.PROB_DIFF_MAX], f[mn.PROB_DIFF_MIN] = max(pdiff), min(pdiff)
        for k in (mn.PROB_DIFF_ABS_MEAN, mn.PROB_DIFF_MAX, mn.PROB_DIFF_MIN):
            scale[k] = 1.0
        f[mn.LOG_RATIO_ABS_MEAN], scale[mn.LOG_RATIO_ABS_MEAN] = mean(absg), mean(absg)
        f[mn.LOG_RATIO_ABS_MAX], scale[mn.LOG_RATIO_ABS_MAX] = max(absg), max(absg)
    seq = {i: 0.0 for i in rows}
    size = {i: 0.0 for i in rows}
    for (i, _), g in zip(kept, gap):
        seq[i] += g
        size[i] += abs(g)
    f[mn.SEQ_LOG_RATIO_MEAN] = mean(list(seq.values()))
    scale[mn.SEQ_LOG_RATIO_MEAN] = mean(list(size.values()))
    return f, scale, left


def assert_figures(got: dict, want: dict, scale: dict, tol: float) -> None:
    """Every figure finite; each of `want` within `tol` of its scale (float32's rounding of each
    token's difference, or float64's)."""
    not_finite = {k: v for k, v in got.items() if not math.isfinite(v)}
    assert not not_finite, f"figures not finite: {not_finite}"
    for k, v in want.items():
        if k in got:
            assert abs(got[k] - v) <= tol * scale[k], (k, got[k], v, scale[k])


TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
AUDIT_ONLY = {mn.LOG_RATIO_ABS_MEAN, mn.LOG_RATIO_ABS_MAX}
MASKS = (torch.bool, torch.int64, torch.float32)


def _measured(b: Batch, dtype=torch.float32, mask_dtype=torch.float32, junk=True,
              source="engine") -> dict:
    d = StepDiagnostics()
    measure(d, b.tensor("pi", dtype, junk), b.tensor("s", dtype, junk), b.tensor("mu", dtype, junk),
            torch.tensor(b.adv), b.mask(mask_dtype), *b.eps, ratio_source=source,
            logp_old=b.tensor("old", dtype, junk), sequence=b.sequence)
    return d.metrics()


@SETTINGS
@given(batches(), st.sampled_from(["engine", "shadow", "recompute"]))
def test_measure_gives_finite_figures_equal_to_float64_by_hand(b, source):
    want, scale, _ = reference(b, source)
    for dtype in (torch.float32, torch.float64):
        got = _measured(b, dtype, source=source)
        assert_figures(got, want, scale, TOL[dtype])
        assert set(want) - AUDIT_ONLY <= set(got)
    clean = _measured(b, junk=False, source=source)
    for mask_dtype in MASKS:          # any mask dtype, anything under mask 0: the same figures
        assert _measured(b, mask_dtype=mask_dtype, source=source) == clean


def test_the_batches_reach_gaps_of_1e4_either_way_and_probabilities_of_e_minus_1e4():
    """What the strategies above reach over the examples of one property test. On hypothesis
    6.170 (derandomized, 100 examples): ℓ_π − ℓ_μ from −10,100 to +10,023 nats, the lowest
    log-prob −10,100.5 (a probability of e^-10100.5), 140 of 339 valid tokens more than 80 nats
    apart (past the bound), 98 with ℓ_π = ℓ_μ."""
    seen = []

    @SETTINGS
    @given(batches())
    def collect(b):
        tokens = [(b.pi[i][t], b.s[i][t], b.mu[i][t]) for i in range(b.rows)
                  for t in range(len(b.valid[i])) if b.valid[i][t]]
        seen.extend((pi - mu, min(pi, s, mu)) for pi, s, mu in tokens)
    collect()
    gaps, lowest = [g for g, _ in seen], min(lp for _, lp in seen)
    assert max(gaps) >= 1e4 and min(gaps) <= -1e4 and lowest <= -1e4, (min(gaps), max(gaps))
    assert 0.0 in gaps and any(-104 < lp < -80 for _, lp in seen)


# ---- the trainer's step metrics ----------------------------------------------------------

TRAINER_RUNS = [("ppo-clip", "engine", "none"), ("ppo-clip", "shadow", "none"),
                ("gspo", "engine", "none"), ("pg-is", "engine", "none")] + [
    ("ppo-clip", "recompute", c) for c in ("none", "token-tis", "token-mis", "token-icepop",
                                            "seq-tis", "seq-mis", "geo-rs")]


def _weights_by_hand(b: Batch, correction: str, cfg) -> dict:
    """is/* by docs/design.md's formulas, ρ = exp(min(ℓ_old − ℓ_μ, 80)) per token or per
    completion (geo-rs: exp(min(|mean|, 80)))."""
    d = [[b.old[i][t] - b.mu[i][t] for t in range(len(b.valid[i])) if b.valid[i][t]]
         for i in range(b.rows)]
    if correction == "none":
        return {}
    if correction.startswith("token"):
        raw = [math.exp(min(x, CAP)) for row in d for x in row]
        if correction == "token-tis":
            w = [min(r, cfg.is_cap) for r in raw]
        elif correction == "token-mis":
            w = [r if r <= cfg.is_cap else 0.0 for r in raw]
        else:
            w = [r if cfg.is_cap_low <= r <= cfg.is_cap else 0.0 for r in raw]
        changed = [x != r for x, r in zip(w, raw)]
    elif correction == "geo-rs":
        raw = [math.exp(min(abs(sum(row) / max(len(row), 1)), CAP)) for row in d]
        w = [1.0 if r <= cfg.geo_cap else 0.0 for r in raw]
        changed = [x == 0 for x in w]
    else:
        raw = [math.exp(min(sum(row), CAP)) for row in d]
        w = ([min(r, cfg.is_cap) for r in raw] if correction == "seq-tis"
             else [r if r <= cfg.is_cap else 0.0 for r in raw])
        changed = [x != r for x, r in zip(w, raw)]
    if not raw:
        return {}
    mean = lambda x: sum(x) / len(x)
    return {mn.IS_WEIGHT_MEAN_RAW: mean(raw), mn.IS_WEIGHT_MAX_RAW: max(raw),
            mn.IS_WEIGHT_MIN_RAW: min(raw), mn.IS_WEIGHT_MEAN: mean(w),
            mn.IS_FRAC_CHANGED: mean(changed)}


def _step_metrics(b: Batch, objective: str, source: str, correction: str,
                  mask_dtype=torch.float32, junk=True) -> dict:
    """A step's metrics as the trainer builds them: the behaviour weights of `prepare`, the
    objective's loss, `measure` with what the loss clipped, then `step_metrics`."""
    from parity.config import make_config
    from parity.objectives import OBJECTIVES, Minibatch, behaviour_weights, log_ratio
    from parity.runs.step_metrics import StepPart, step_metrics
    cfg = make_config({"objective": objective, "ratio_source": source, "correction": correction})
    obj = OBJECTIVES[objective]
    pi, s, mu, old = (b.tensor(k, junk=junk) for k in ("pi", "s", "mu", "old"))
    mask, adv = b.mask(mask_dtype), torch.tensor(b.adv)
    weights, prep = None, {}
    if source == "recompute":
        weights, prep = behaviour_weights(old, mu, mask, correction, cfg.is_cap, cfg.geo_cap,
                                          cfg.is_cap_low)
        weights = None if correction == "none" else weights
    mb = Minibatch(log_r=log_ratio(source, pi, mu, s, old), logp_pi=pi, logp_s=s, mask=mask,
                   adv=adv, rewards=adv, weights=weights)
    loss = obj.loss(cfg, mb, lambda x, n, unit: x)
    diag = StepDiagnostics()
    measure(diag, pi, s, mu, adv, mask, *obj.clip_range(cfg), clipped=loss.clipped,
            sequence=obj.clip == "sequence")
    part = StepPart(rewards=b.adv, parts={"reward": b.adv}, n_tok=float(mask.sum()), finished=0,
                    diag=diag, prep=prep, extras=loss.metrics,
                    # the loss itself is the update's, not a figure of the tokens: a ratio that
                    # overflows makes it non-finite and the update is skipped and counted
                    # (tests/test_skipped_updates.py)
                    policy_loss=0.0, times={mn.STEP_S: 1.0})
    return step_metrics([part], cfg)


@SETTINGS
@given(batches(completions=True), st.sampled_from(TRAINER_RUNS))
def test_the_trainers_step_metrics_are_finite_and_exact(b, run):
    from parity.config import make_config
    objective, source, correction = run
    cfg = make_config({"objective": objective, "ratio_source": source, "correction": correction})
    from parity.objectives import OBJECTIVES
    b = dataclasses.replace(b, eps=OBJECTIVES[objective].clip_range(cfg),
                            sequence=objective == "gspo")
    want, scale, _ = reference(b, source)
    if objective == "pg-is":           # no clip: nothing on a clipped branch
        want.update({k: 0.0 for k in (mn.CLIP_FRAC, mn.PHANTOM_FRAC)})
        want.pop(mn.HIDDEN_FRAC, None)
        want.pop(mn.ALPHA_CLIP_FRAC, None)
    weights = _weights_by_hand(b, correction, cfg)
    want.update(weights)
    scale.update({k: abs(v) + 1.0 for k, v in weights.items()})
    got = _step_metrics(b, objective, source, correction)
    assert_figures(got, want, scale, TOL[torch.float32])
    clean = _step_metrics(b, objective, source, correction, junk=False)
    for mask_dtype in MASKS:
        assert _step_metrics(b, objective, source, correction, mask_dtype) == clean


# ---- the audit's Measurement --------------------------------------------------------------

def _audited(b: Batch, eps: float, mask_dtype=torch.float32, junk=True) -> tuple[dict, str]:
    """The audit's metrics of one scored batch, and what it printed on stderr."""
    import contextlib
    import io

    from parity.audit.measurement import Measurement
    from parity.config import AuditSettings
    from parity.logprobs import Rollout, Sampling
    B, T = len(b.valid), len(b.valid[0])
    r = Rollout(prompt_ids=torch.ones(B, 1, dtype=torch.long),
                prompt_mask=torch.ones(B, 1, dtype=torch.long),
                completion_ids=torch.zeros(B, T, dtype=torch.long),
                completion_mask=b.mask(mask_dtype), engine_logprobs=b.tensor("mu", junk=junk),
                finished=torch.zeros(B, dtype=torch.bool))
    meas = Measurement(AuditSettings(eps=eps), torch.device("cpu"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        meas.add_scored(r, b.tensor("pi", junk=junk), b.tensor("s", junk=junk), None, [],
                        torch.tensor(b.adv), Sampling(), torch.arange(B), 0)
        metrics = meas.results()["metrics"]
    return metrics, err.getvalue()


@SETTINGS
@given(batches(unusable=("pi", "s", "mu")), st.sampled_from([0.2, 0.0013]))
def test_the_audits_measurement_is_finite_and_exact(b, eps):
    b = dataclasses.replace(b, eps=(eps, eps), sequence=False)
    want, scale, left = reference(b)
    got, err = _audited(b, eps)
    clean = dict(got)
    assert {k: got.pop(k, 0) for k in left.counts()} == left.counts()
    # one warning for each kind, naming the count
    assert err.count("\n") == bool(left.non_finite) + bool(left.positive)
    assert not left.non_finite or f"{left.non_finite} token log-probs" in err
    assert not left.positive or f"{left.positive} token log-probs" in err
    assert_figures(got, want, scale, TOL[torch.float32])
    assert set(want) <= set(got)
    assert _audited(b, eps, junk=False)[0] == clean
    for mask_dtype in MASKS:
        assert _audited(b, eps, mask_dtype)[0] == clean


# ---- TRL's GRPOTrainer and AsyncGRPO, verl ----------------------------------------------

@pytest.mark.e2e
@SETTINGS
@given(batches(unusable=("pi", "s", "mu", "old")),
       st.sampled_from(["engine", "shadow", "recompute"]), st.booleans())
def test_trls_micro_batch_figures_are_finite_and_exact(b, source, fresh):
    from parity.integrations.trl import micro_batch_diagnostics

    def figures(mask_dtype=torch.float32, junk=True):
        t = {k: b.tensor(k, junk=junk) for k in ("pi", "s", "mu", "old")}
        # _compute_loss hands TRL ℓ_μ as ℓ_old unless the ratio is recompute's
        old = t["old"] if source == "recompute" else t["mu"]
        diag, left, _ = micro_batch_diagnostics(t["pi"], t["s"], t["mu"], old,
                                                torch.tensor(b.adv), b.mask(mask_dtype), *b.eps,
                                                ratio_source=source, sequence=b.sequence,
                                                first=fresh)
        return diag.metrics(), left
    checked = ("pi", "s", "mu", "old") if source == "recompute" else ("pi", "s", "mu")
    want, scale, left = reference(b, source, checked)
    got, n = figures()
    assert n == left
    assert_figures(got, want, scale, TOL[torch.float32])
    assert figures(junk=False) == (got, left)
    for mask_dtype in MASKS:
        assert figures(mask_dtype) == (got, left)


@pytest.mark.e2e
@SETTINGS
@given(batches(unusable=("pi", "s", "mu", "old")),
       st.sampled_from(["engine", "shadow", "recompute"]))
def test_async_grpos_packed_figures_are_finite_and_exact(b, source):
    """AsyncGRPO's terms are the valid tokens alone, one sample after another."""
    from parity.integrations.trl_async import packed_diagnostics
    b = dataclasses.replace(b, sequence=False)
    present = [i for i in range(b.rows) if any(b.valid[i])]
    if not present:
        return
    terms = [(i, t) for i in present for t in range(len(b.valid[i])) if b.valid[i][t]]
    flat = {k: b.tensor(k)[tuple(zip(*terms))] for k in ("pi", "s", "mu", "old")}
    seg = torch.tensor([present.index(i) for i, _ in terms])
    adv = torch.tensor([b.adv[i] for i, _ in terms])
    old = flat["old"] if source == "recompute" else flat["mu"]
    got, n = packed_diagnostics(flat["pi"], flat["s"], old, flat["mu"], adv, seg, *b.eps,
                                ratio_source=source)
    checked = ("pi", "s", "mu", "old") if source == "recompute" else ("pi", "s", "mu")
    want, scale, left = reference(b, source, checked, rows=present)
    want.pop(mn.KERNEL_GAP_ABS_MEAN, None)
    assert n == left
    assert_figures(got, want, scale, TOL[torch.float32])


@pytest.mark.e2e
@SETTINGS
@given(batches(unusable=("pi", "mu")), st.sampled_from(["token", "sequence", None]))
def test_the_verl_plugins_figures_are_finite_and_exact(b, clip):
    """verl's batch holds ℓ_old (here ℓ_π) and ℓ_μ, which stands for ℓ_s: α = 0."""
    pytest.importorskip("verl")
    from verl import DataProto

    from parity.integrations.verl import NOT_MEASURED, PREFIX, RunSettings, step_figures
    eps = b.eps if clip else (None, None)
    b = dataclasses.replace(b, s=b.mu, junk={**b.junk, "s": b.junk["mu"]},
                            bad={**b.bad, "s": b.bad["mu"]}, eps=eps, sequence=clip == "sequence")
    want, scale, left = reference(b, "engine", ("pi", "mu"))
    for name in NOT_MEASURED:
        want.pop(name, None)

    def figures(mask_dtype=torch.float32, junk=True, run=None):
        mask = b.mask(mask_dtype)
        batch = DataProto.from_dict(tensors={
            "old_log_probs": b.tensor("pi", junk=junk),
            "rollout_log_probs": b.tensor("mu", junk=junk),
            "response_mask": mask, "advantages": torch.tensor(b.adv)[:, None] * mask.float()})
        run = run or RunSettings(*(eps if clip else (0.2, 0.2)), clip=clip)
        return {k.removeprefix(PREFIX): v for k, v in step_figures(batch, run).items()
                if k.startswith(PREFIX)}
    run = RunSettings(*(eps if clip else (0.2, 0.2)), clip=clip)
    logger = logging.getLogger("parity.integrations.verl")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        got = figures(run=run)
        assert figures(run=run) == got          # a second step: no second warning
    finally:
        logger.removeHandler(handler)
    assert len(seen) == bool(left.non_finite) + bool(left.positive)
    assert {k: got.pop(k, 0) for k in left.counts()} == left.counts()
    if not clip:
        want = {k: v for k, v in want.items() if not k.startswith(mn.CLIP)}
    assert_figures(got, want, scale, TOL[torch.float64])
    for again in [figures(junk=False)] + [figures(mask_dtype) for mask_dtype in MASKS]:
        for k in left.counts():
            again.pop(k, None)
        assert again == got


# ---- the loss ---------------------------------------------------------------------------------

def test_the_ppo_loss_and_its_gradient_stay_finite_past_any_gap():
    """PPO's ratio at a gap of 1e4 nats, for A < 0, A = 0 and A > 0: the loss and the gradient
    are finite, the token past the bound has no gradient, and the tokens below it get the
    unbounded formula's loss and gradient bit for bit."""
    from parity.objectives.losses import LOG_RATIO_CAP, ppo_clip_loss, ppo_clip_token_loss
    for a in (-1.0, 0.0, 1.0):
        log_r = torch.tensor([[1e4, 0.03, -0.4, LOG_RATIO_CAP - 1]], requires_grad=True)
        adv = torch.tensor([a])
        loss, _ = ppo_clip_loss(log_r, adv, torch.ones(1, 4), 0.2, 0.2)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(log_r.grad).all()
        assert log_r.grad[0, 0] == 0
        below = log_r.detach()[:, 1:].clone().requires_grad_(True)
        r = torch.exp(below)   # the formula without the bound, where it cannot overflow
        plain = -torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a)
        plain.sum().backward()
        mine = log_r.detach()[:, 1:].clone().requires_grad_(True)
        ppo_clip_token_loss(mine, torch.tensor([[a]]), 0.2, 0.2).sum().backward()
        assert torch.equal(mine.grad, below.grad)
        assert torch.equal(ppo_clip_token_loss(log_r.detach()[:, 1:], torch.tensor([[a]]), 0.2,
                                               0.2), plain.detach())
