"""parity.objectives against independent float64 loop references.

References use plain Python floats and `math`, with gradients derived by hand from each
docstring's equation (never autograd), so a vectorisation slip, sign error, wrong normaliser,
clip on the wrong side or a padding token counted shows up as a mismatch. Padding positions
carry garbage, and the gradient there must be exactly 0.
"""

import math

import pytest
import torch

from parity.objectives import (
    aggregate,
    behaviour_weights,
    dpo_loss,
    dpo_pairs,
    gae,
    grpo_advantages,
    gspo_loss,
    log_ratio,
    pg_is_loss,
    ppo_clip_loss,
    value_loss,
    whiten,
)

F64 = torch.float64
B, T = 5, 7
LENS = [7, 3, 1, 5, 6]
N_TOK = sum(LENS)
MAX_LEN = 9                      # != T: a token-sum that divides by T instead is caught
AGGS = ["seq-mean", "token-mean", "token-sum"]
SEQ_ADV = [1.3, -0.7, 0.5, -1.1, 2.0]   # both signs, so both clip sides are exercised
TIGHT = {"rel": 1e-10, "abs": 1e-12}
F32 = {"rel": 1e-5, "abs": 1e-6}   # float32 results or outputs vs the float64 reference


def _mask(dtype=F64):
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENS], dtype=dtype)


def _rand(g, std=1.0, mean=0.0, pad=1e3, dtype=F64):
    """[B, T] normal draws with `pad` written on the padding positions."""
    x = torch.randn(B, T, generator=g, dtype=F64) * std + mean
    return torch.where(_mask() > 0, x, torch.full_like(x, pad)).to(dtype)


def _flat(x):
    return [float(v) for v in torch.as_tensor(x).detach().reshape(-1).tolist()]


def _check(got, ref, tol=TIGHT):
    assert _flat(got) == pytest.approx(_flat(torch.as_tensor(ref, dtype=F64)), **tol)


def _check_pad_grad(grad):
    # exactly zero (not merely small) and finite: garbage at padding must not leak anywhere
    pad = _mask() == 0
    assert torch.isfinite(grad).all() and (grad[pad] == 0).all()


def _norm(agg, i):
    return {"seq-mean": 1 / (B * LENS[i]), "token-mean": 1 / N_TOK,
            "token-sum": 1 / (B * MAX_LEN)}[agg]


def _pred(x, a, eps_low, eps_high):
    """docs/design.md's C(x, A), in its log form."""
    hi = math.log1p(eps_high) if eps_high is not None else math.inf
    lo = math.log1p(-eps_low) if eps_low is not None else -math.inf
    return (a > 0 and x > hi) or (a < 0 and x < lo)


def _ref_ppo(x, adv, w, eps_low, eps_high, agg):
    """L = agg(w · −min(rA, clip(r)A)); ∂/∂x = −w·A·r off the clipped branch, 0 on it."""
    lo = 1 - eps_low if eps_low is not None else 0.0
    hi = 1 + eps_high if eps_high is not None else math.inf
    loss, grad, clip = 0.0, [[0.0] * T for _ in range(B)], [[False] * T for _ in range(B)]
    for i, n in enumerate(LENS):
        for t in range(n):
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            r, wt, k = math.exp(x[i][t]), (w[i][t] if w else 1.0), _norm(agg, i)
            loss += k * wt * -min(r * a, min(max(r, lo), hi) * a)
            clip[i][t] = _pred(x[i][t], a, eps_low, eps_high)
            grad[i][t] = 0.0 if clip[i][t] else -k * wt * a * r
    return loss, grad, clip


# ---- 1. token-level PPO-clip ---------------------------------------------------------------

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("eps", [(0.2, 0.28), (None, None)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("token_adv", [False, True])
def test_ppo_clip_loss_matches_reference(agg, eps, weighted, token_adv):
    # catches: clip on the wrong side / symmetric eps, wrong normaliser per agg, padding counted,
    # token advantages not broadcast per token, weights not applied or not detached
    g = torch.Generator().manual_seed(12)
    x = _rand(g, std=0.35, pad=30.0).requires_grad_()      # exp(30) stays finite
    adv = _rand(g, pad=1e3) if token_adv else torch.tensor(SEQ_ADV, dtype=F64)
    w = _rand(g, std=0.3, mean=1.0, pad=1e3).requires_grad_() if weighted else None
    loss, clipped = ppo_clip_loss(x, adv, _mask(), *eps, agg=agg, max_len=MAX_LEN, weights=w)
    loss.backward()
    ref, ref_grad, ref_clip = _ref_ppo(x.tolist(), adv.tolist(), w.tolist() if w is not None
                                       else None, *eps, agg)
    assert loss.item() == pytest.approx(ref, **TIGHT)
    _check(x.grad, ref_grad)
    _check_pad_grad(x.grad)
    assert clipped.tolist() == ref_clip
    if eps[0] is not None:   # the inputs really clip on both sides, or the test proves little
        sides = {math.copysign(1, x[i, t].item()) for i in range(B) for t in range(T)
                 if ref_clip[i][t]}
        assert sides == {1.0, -1.0}
    else:
        assert not clipped.any()
    if w is not None:
        assert w.grad is None


def test_ppo_clip_loss_float32():
    g = torch.Generator().manual_seed(13)
    x = _rand(g, std=0.35, pad=30.0, dtype=torch.float32).requires_grad_()
    adv = torch.tensor(SEQ_ADV)
    loss, _ = ppo_clip_loss(x, adv, _mask(torch.float32), 0.2, 0.28, agg="token-mean")
    loss.backward()
    ref, ref_grad, _ = _ref_ppo(x.tolist(), SEQ_ADV, None, 0.2, 0.28, "token-mean")
    assert loss.item() == pytest.approx(ref, **F32)
    _check(x.grad, ref_grad, F32)


# exp(log r) = inf at a padding position must not turn into inf * 0 = NaN.
@pytest.mark.parametrize("eps", [(0.2, 0.28), (None, None)])
def test_ppo_clip_loss_ignores_overflowing_padding(eps):
    x = torch.tensor([[0.1, 1e3]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]], dtype=F64)
    loss, _ = ppo_clip_loss(x, torch.tensor([1.0], dtype=F64), mask, *eps)
    loss.backward()
    assert math.isfinite(loss.item()) and x.grad[0, 1].item() == 0.0


# ---- 2. ratio sources ----------------------------------------------------------------------

@pytest.mark.parametrize("source", ["engine", "shadow", "recompute"])
def test_log_ratio_value_and_gradient(source):
    # catches: shadow value still containing β, shadow gradient not r·∇ℓ_π, and any gradient
    # leaking into ℓ_s / ℓ_old (they are recorded data)
    g = torch.Generator().manual_seed(2)
    pi, mu, s, old = (_rand(g, std=0.5, mean=-1.5).requires_grad_() for _ in range(4))
    lr = log_ratio(source, pi, mu, s, old)
    P, M, S, OLD = pi.tolist(), mu.tolist(), s.tolist(), old.tolist()
    ref = [[{"engine": P[i][t] - M[i][t], "shadow": S[i][t] - M[i][t],
             "recompute": P[i][t] - OLD[i][t]}[source] for t in range(T)] for i in range(B)]
    _check(lr, ref)
    torch.exp(lr).sum().backward()
    # ∂ exp(log r)/∂ℓ_π = r with r the *value* of the ratio, for every source
    _check(pi.grad, [[math.exp(v) for v in row] for row in ref])
    assert s.grad is None and old.grad is None
    if source != "engine":
        assert mu.grad is None


# ---- 3. behaviour weights ------------------------------------------------------------------

CORRECTIONS = ["none", "token-tis", "token-mis", "token-icepop", "seq-tis", "seq-mis", "geo-rs"]
CAP = {"token-tis": 1.2, "token-mis": 1.2, "token-icepop": 1.2, "seq-tis": 1.5, "seq-mis": 1.5}
CAP_LOW = 0.8   # token-icepop's lower bound: ρ in [0.4, 2.5] here, so both tails are masked
GEO_CAP = 1.15


def _ref_weights(old, mu, corr):
    d = [[old[i][t] - mu[i][t] for t in range(n)] for i, n in enumerate(LENS)]
    w = [[0.0] * T for _ in range(B)]
    if corr == "none":
        return [[1.0 if t < n else 0.0 for t in range(T)] for n in LENS], {}, 0
    if corr.startswith("token"):
        raw = [[math.exp(v) for v in row] for row in d]
        cap = CAP[corr]
        for i, n in enumerate(LENS):
            for t in range(n):
                p = raw[i][t]
                if corr == "token-tis":
                    w[i][t] = min(p, cap)
                elif corr == "token-icepop":
                    w[i][t] = p if CAP_LOW <= p <= cap else 0.0
                else:
                    w[i][t] = p if p <= cap else 0.0
        raw_l = [p for row in raw for p in row]
        w_l = [w[i][t] for i, n in enumerate(LENS) for t in range(n)]
    else:
        if corr == "geo-rs":
            raw_l = [math.exp(abs(sum(row) / len(row))) for row in d]
            w_l = [1.0 if p <= GEO_CAP else 0.0 for p in raw_l]
        else:
            raw_l = [math.exp(sum(row)) for row in d]
            cap = CAP[corr]
            w_l = [min(p, cap) if corr == "seq-tis" else (p if p <= cap else 0.0) for p in raw_l]
        for i, n in enumerate(LENS):
            w[i][:n] = [w_l[i]] * n
    changed = [(wv == 0.0) if corr == "geo-rs" else (wv != p) for wv, p in zip(w_l, raw_l)]
    stats = {"is/weight_mean_raw": sum(raw_l) / len(raw_l), "is/weight_max_raw": max(raw_l),
             "is/weight_min_raw": min(raw_l), "is/weight_mean": sum(w_l) / len(w_l),
             "is/frac_changed": sum(changed) / len(changed)}
    return w, stats, sum(changed)


@pytest.mark.parametrize("corr", CORRECTIONS)
def test_behaviour_weights_match_reference(corr):
    # catches: TIS/MIS swapped, cap on ρ vs log ρ, sequence sum including padding, geo using the
    # sum instead of the mean or forgetting |·|, stats over padding tokens instead of valid ones
    g = torch.Generator().manual_seed(3)
    old = _rand(g, std=0.3, mean=-2.0, pad=1e3)
    mu = _rand(g, std=0.3, mean=-2.0, pad=-1e3)
    mu = mu + torch.tensor([0.0, 0.1, -0.3, 0.2, 0.0], dtype=F64)[:, None] * _mask()
    w, stats = behaviour_weights(old, mu, _mask(), corr, CAP.get(corr, 2.0), GEO_CAP, CAP_LOW)
    ref_w, ref_stats, n_changed = _ref_weights(old.tolist(), mu.tolist(), corr)
    valid = _mask() > 0
    _check(w[valid], torch.tensor(ref_w, dtype=F64)[valid], F32)   # weights come back as float32
    if corr != "none":
        assert (w[~valid] == 0).all()
        n_units = N_TOK if corr.startswith("token") else B
        assert 0 < n_changed < n_units      # inputs put some weights beyond the cap, not all
    assert set(stats) == set(ref_stats)
    for k, v in ref_stats.items():
        assert stats[k] == pytest.approx(v, **TIGHT), k


# Weights are 0 on padding for every correction, "none" included.
def test_behaviour_weights_none_is_zero_on_padding():
    z = torch.zeros(B, T, dtype=F64)
    w, _ = behaviour_weights(z, z, _mask(), "none", 2.0, 2.0)
    assert (w[_mask() == 0] == 0).all()


# ---- 4. GSPO -------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_loss_matches_reference(weighted):
    # catches: token mean vs sequence sum in log s, padding in the mean, the small clip range
    # applied on the wrong side, weights not averaged over valid tokens only
    eps_low, eps_high = 3e-4, 4e-4
    # sequence means of log r: clipped above (A>0), clipped below (A<0), inside, wrong side x2
    seq_log_s = torch.tensor([1e-3, -1e-3, 1e-4, -2e-3, 5e-5], dtype=F64)
    adv = torch.tensor([1.3, -0.7, 0.5, 1.1, -2.0], dtype=F64)
    g, m = torch.Generator().manual_seed(4), _mask()
    noise = torch.randn(B, T, generator=g, dtype=F64) * 1e-3 * m
    x = noise - (noise.sum(-1) / m.sum(-1))[:, None] + seq_log_s[:, None]
    x = torch.where(m > 0, x, torch.full_like(x, 1e3)).requires_grad_()
    w = None
    if weighted:
        w_seq = [0.7, 1.4, 1.0, 0.3, 2.0]
        w = torch.where(m > 0, torch.tensor(w_seq, dtype=F64)[:, None].expand(B, T),
                        torch.full((B, T), 1e3, dtype=F64)).requires_grad_()
    loss, clipped = gspo_loss(x, adv, m, eps_low, eps_high, weights=w)
    loss.backward()
    X, A = x.tolist(), adv.tolist()
    ref, grad, ref_clip = 0.0, [[0.0] * T for _ in range(B)], []
    for i, n in enumerate(LENS):
        ls = sum(X[i][:n]) / n
        s, wi = math.exp(ls), (w_seq[i] if weighted else 1.0)
        ref += wi * -min(s * A[i], min(max(s, 1 - eps_low), 1 + eps_high) * A[i]) / B
        c = _pred(ls, A[i], eps_low, eps_high)
        ref_clip.append(c)
        for t in range(n):   # ∂s/∂x_it = s / n_i
            grad[i][t] = 0.0 if c else -wi * A[i] * s / (n * B)
    assert ref_clip == [True, True, False, False, False]
    assert loss.item() == pytest.approx(ref, **TIGHT)
    _check(x.grad, grad)
    _check_pad_grad(x.grad)
    assert clipped.tolist() == [[ref_clip[i] and t < n for t in range(T)]
                                for i, n in enumerate(LENS)]
    if w is not None:
        assert w.grad is None


# ---- 5. PG with sequence IS ----------------------------------------------------------------

@pytest.mark.parametrize("agg", AGGS)
def test_pg_is_loss_matches_reference(agg):
    # catches: ρ from the token mean instead of the sum, cap applied as a mask, gradient through
    # ρ (it must be a stop-gradient), padding in ρ or in the aggregation
    cap = 1.5
    g = torch.Generator().manual_seed(5)
    pi = _rand(g, std=0.5, mean=-1.5, pad=1e3).requires_grad_()
    shift = torch.tensor([0.15, -0.1, 0.9, 0.0, -0.05], dtype=F64)[:, None] * _mask()
    log_r = (_rand(g, std=0.1, pad=1e3) + shift).requires_grad_()
    adv = torch.tensor(SEQ_ADV, dtype=F64)
    loss, stats = pg_is_loss(pi, log_r, adv, _mask(), cap, agg=agg, max_len=MAX_LEN)
    loss.backward()
    P, LR = pi.tolist(), log_r.tolist()
    rho = [math.exp(sum(LR[i][:n])) for i, n in enumerate(LENS)]
    w = [min(p, cap) for p in rho]   # ρ_i over valid tokens only, capped, a constant per sequence
    assert 0 < sum(p > cap for p in rho) < B
    ref, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i, n in enumerate(LENS):
        for t in range(n):
            k = _norm(agg, i)
            ref += -k * w[i] * SEQ_ADV[i] * P[i][t]
            grad[i][t] = -k * w[i] * SEQ_ADV[i]
    assert loss.item() == pytest.approx(ref, **TIGHT)
    _check(pi.grad, grad)
    _check_pad_grad(pi.grad)
    assert log_r.grad is None
    ref_stats = {"pg_is/weight_mean_raw": sum(rho) / B, "pg_is/weight_max_raw": max(rho),
                 "pg_is/weight_mean": sum(w) / B,
                 "pg_is/frac_changed": sum(p > cap for p in rho) / B}
    assert set(stats) == set(ref_stats)
    for k, v in ref_stats.items():
        assert stats[k] == pytest.approx(v, rel=1e-7), k   # frac_changed is a float32 mean


# ---- 6. value loss -------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_reference(clip):
    # catches: min instead of max, clip around R instead of V_old, missing ½, padding counted;
    # the gradient must vanish where the clipped (constant) branch is the larger one
    g = torch.Generator().manual_seed(6)
    old = _rand(g, pad=1e3)
    v = (old + _rand(g, std=0.4, pad=0.0)).requires_grad_()
    ret = _rand(g, pad=-1e3)
    loss = value_loss(v, old, ret, _mask(), clip)
    loss.backward()
    V, OLD, R = v.tolist(), old.tolist(), ret.tolist()
    ref, grad, n_dead = 0.0, [[0.0] * T for _ in range(B)], 0
    for i, n in enumerate(LENS):
        for t in range(n):
            u = (V[i][t] - R[i][t]) ** 2
            gu = (V[i][t] - R[i][t]) / N_TOK
            if clip is not None:
                dv = V[i][t] - OLD[i][t]
                vc = OLD[i][t] + max(-clip, min(clip, dv))
                u2 = (vc - R[i][t]) ** 2
                if u2 > u:     # clipped branch wins; it depends on V only inside the clip range
                    gu = (vc - R[i][t]) / N_TOK if abs(dv) < clip else 0.0
                    n_dead += gu == 0.0
                u = max(u, u2)
            ref += 0.5 * u / N_TOK
            grad[i][t] = gu
    assert loss.item() == pytest.approx(ref, **TIGHT)
    _check(v.grad, grad)
    _check_pad_grad(v.grad)
    if clip is not None:
        assert n_dead > 0


# ---- 7. GAE --------------------------------------------------------------------------------

def _ref_gae(rew, val, gamma, lam):
    adv, ret = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i, n in enumerate(LENS):
        running = 0.0
        for t in reversed(range(n)):
            v_next = val[i][t + 1] if t + 1 < n else 0.0
            delta = (rew[i] if t == n - 1 else 0.0) + gamma * v_next - val[i][t]
            running = delta + gamma * lam * running
            adv[i][t], ret[i][t] = running, running + val[i][t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_matches_reference(gamma, lam):
    # catches: reward paid at T−1 instead of the last valid token, V of a padding token used as
    # V_{t+1}, γ and λ swapped, padding non-zero in advantages or returns
    g = torch.Generator().manual_seed(7)
    rew = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.7], dtype=F64)
    val = _rand(g, pad=1e3)
    adv, ret = gae(rew, val, _mask(), gamma, lam)
    ref_adv, ref_ret = _ref_gae(rew.tolist(), val.tolist(), gamma, lam)
    _check(adv, ref_adv, F32)   # gae returns float32
    _check(ret, ref_ret, F32)
    pad = _mask() == 0
    assert (adv[pad] == 0).all() and (ret[pad] == 0).all()
    if gamma == lam == 1.0:     # Monte-Carlo: A_t = R − V_t
        _check(adv[~pad], [rew[i].item() - val[i, t].item()
                           for i in range(B) for t in range(T) if not pad[i, t]], F32)


# ---- 8. DPO --------------------------------------------------------------------------------

def test_dpo_pairs_hand_case():
    # groups of 3: tie for best (first wins), all equal (no pair), tie for worst (first wins)
    r = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 0.0, 5.0, 0.0, 3.0, 1.0, 1.0])
    chosen, rejected = dpo_pairs(r, 3)
    assert chosen.tolist() == [0, 7, 9] and rejected.tolist() == [1, 6, 10]


def test_dpo_loss_matches_reference():
    # catches: chosen/rejected swapped (sign of m), padding in the sequence sums, sum instead of
    # mean over pairs, scale missing from the gradient, a row in two pairs not accumulating
    scale = 0.3
    g = torch.Generator().manual_seed(8)
    pi = _rand(g, std=0.5, mean=-1.5, pad=1e3).requires_grad_()
    ref_lp = _rand(g, std=0.5, mean=-1.5, pad=-1e3)
    chosen, rejected = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 1])
    loss, m = dpo_loss(pi, ref_lp, _mask(), chosen, rejected, scale)
    loss.backward()
    P, Rf, pairs = pi.tolist(), ref_lp.tolist(), list(zip(chosen.tolist(), rejected.tolist()))
    S = [sum(P[i][t] - Rf[i][t] for t in range(n)) for i, n in enumerate(LENS)]
    ms, K = [scale * (S[c] - S[r]) for c, r in pairs], len(pairs)
    ref = sum(math.log1p(math.exp(-mk)) for mk in ms) / K
    grad = [[0.0] * T for _ in range(B)]
    for (c, r), mk in zip(pairs, ms):
        dm = -1 / (1 + math.exp(mk)) / K      # d(−log σ(m))/dm = −σ(−m)
        for t in range(T):
            if t < LENS[c]:
                grad[c][t] += scale * dm
            if t < LENS[r]:
                grad[r][t] -= scale * dm
    _check(m, ms)
    assert loss.item() == pytest.approx(ref, **TIGHT)
    _check(pi.grad, grad)
    _check_pad_grad(pi.grad)


def test_dpo_loss_without_pairs_is_zero_and_backpropagates():
    pi = torch.randn(B, T, dtype=F64, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    loss, m = dpo_loss(pi, torch.zeros(B, T, dtype=F64), _mask(), empty, empty, 0.1)
    loss.backward()
    assert loss.item() == 0.0 and m.numel() == 0
    assert pi.grad is not None and (pi.grad == 0).all()


# ---- 9-10. aggregation, whitening, GRPO ----------------------------------------------------

def test_aggregate_hand_computed():
    # lengths 2 and 1; the garbage at padding would change every mode if it were counted
    x = torch.tensor([[1.0, 2.0, 1e3], [4.0, 1e3, 1e3]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    assert float(aggregate(x, mask, "seq-mean", 4)) == pytest.approx((1.5 + 4.0) / 2, **TIGHT)
    assert float(aggregate(x, mask, "token-mean", 4)) == pytest.approx(7 / 3, **TIGHT)
    assert float(aggregate(x, mask, "token-sum", 4)) == pytest.approx(7 / 8, **TIGHT)


def test_whiten_matches_reference():
    # catches: statistics over padding, biased std
    g = torch.Generator().manual_seed(9)
    x = _rand(g, std=2.0, mean=0.5, pad=1e3)
    got = whiten(x, _mask())
    vals = [x[i, t].item() for i, n in enumerate(LENS) for t in range(n)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    ref = [[(x[i, t].item() - mean) / (std + 1e-8) if t < n else 0.0 for t in range(T)]
           for i, n in enumerate(LENS)]
    _check(got, ref)
    # a single valid token: no spread, std falls back to 1
    one = torch.tensor([[3.0, 1e3]], dtype=F64)
    assert whiten(one, torch.tensor([[1.0, 0.0]], dtype=F64)).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages_random_groups(scale):
    # catches: groups formed across prompts (strided instead of consecutive), biased std
    g = torch.Generator().manual_seed(10)
    r = torch.randn(12, generator=g, dtype=F64)
    got = grpo_advantages(r, 4, scale=scale)
    R, ref = r.tolist(), []
    for k in range(3):
        grp = R[4 * k: 4 * k + 4]
        mu = sum(grp) / 4
        sd = math.sqrt(sum((v - mu) ** 2 for v in grp) / 3)
        ref += [(v - mu) / (sd + 1e-4) if scale else v - mu for v in grp]
    _check(got, ref, F32)
