"""α/β decomposition, clip attribution and the KL estimates, against hand-computed cases and an
exact enumeration of every completion of a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from parity.diagnostics import (
    Shadow,
    StepDiagnostics,
    attribute,
    clip_fractions,
    exact_kl,
    kl_estimates,
)
from parity.logprobs import Rollout, Sampling
from parity.models.forward import score
from parity.objectives import clip_predicate


def test_decomposition_by_hand():
    # Three tokens, one padding: ℓ_μ, ℓ_s, ℓ_π chosen so α and β are known exactly.
    mu = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    s = torch.tensor([[-0.9, -2.0, -0.75, 0.0]])
    pi = torch.tensor([[-0.85, -2.25, -0.75, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    att = attribute(pi, s, mu, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert torch.allclose(att.alpha, torch.tensor([[0.1, 0.0, -0.25, 0.0]]), atol=1e-6)
    assert torch.allclose(att.beta, torch.tensor([[0.05, -0.25, 0.0, 0.0]]), atol=1e-6)
    # α + β is the log-ratio ℓ_π − ℓ_μ on valid tokens.
    assert torch.allclose((att.alpha + att.beta) * mask, (pi - mu) * mask, atol=1e-6)


def _c(x: float, a: float, lo: float, hi: float) -> bool:
    """docs/design.md's C(x, A), written out separately from the library's vectorised version."""
    return (a > 0 and x > math.log(1 + hi)) or (a < 0 and x < math.log(1 - lo))


# (α, β, A): chosen on both sides of asymmetric bounds log(1 − 0.1) = −0.105, log(1.3) = 0.262.
CASES = [
    (0.0, 0.3, 1.0),     # phantom: β alone pushes past 1 + ε_high
    (0.3, -0.1, 1.0),    # hidden: α is past the bound, β pulls it back inside
    (0.3, 0.1, 1.0),     # clipped by α, and still clipped: neither phantom nor hidden
    (0.0, -0.2, 1.0),    # A > 0 never clips on the low side
    (0.0, -0.2, -1.0),   # phantom on the low side (ε_low = 0.1)
    (-0.15, 0.1, -1.0),  # hidden on the low side
    (0.0, 0.2, -1.0),    # A < 0 never clips on the high side (0.2 < 0.262 anyway)
    (0.0, 0.5, 0.0),     # A = 0: nothing ever clips
    (0.0, -0.5, 0.0),
    (0.2, 0.0, 1.0),     # 0.2 < log 1.3: inside with ε_high = 0.3 (with 0.2 it would clip)
]
EXPECTED = [  # clipped, phantom, hidden, alpha_clipped
    (1, 1, 0, 0), (0, 0, 1, 1), (1, 0, 0, 1), (0, 0, 0, 0), (1, 1, 0, 0),
    (0, 0, 1, 1), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0),
]


def test_clip_attribution_truth_table():
    lo, hi = 0.1, 0.3
    alpha = torch.tensor([[c[0] for c in CASES]])
    beta = torch.tensor([[c[1] for c in CASES]])
    adv = torch.tensor([[c[2] for c in CASES]])
    mu = torch.zeros_like(alpha) - 1.0
    att = attribute(mu + alpha + beta, mu + alpha, mu, adv, torch.ones_like(alpha), lo, hi)
    got = list(zip(att.clipped[0].tolist(), att.phantom[0].tolist(), att.hidden[0].tolist(),
                   att.alpha_clipped[0].tolist()))
    assert [tuple(int(v) for v in g) for g in got] == EXPECTED
    for (a, b, A), (clipped, _, _, a_clipped) in zip(CASES, EXPECTED):
        assert _c(a + b, A, lo, hi) == bool(clipped)
        assert _c(a, A, lo, hi) == bool(a_clipped)
    # The library's predicate agrees with the written-out one on a grid, including the bounds.
    xs = torch.linspace(-0.5, 0.5, 101)
    for A in (-2.0, 0.0, 3.0):
        got = clip_predicate(xs, torch.full_like(xs, A), lo, hi).tolist()
        assert got == [_c(float(x), A, lo, hi) for x in xs]


def test_padding_and_no_clip():
    att = attribute(torch.tensor([[0.0, 5.0]]), torch.zeros(1, 2), torch.full((1, 2), -5.0),
                    torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), None, None)
    assert not att.clipped.any() and not att.phantom.any()     # eps None: no clip at all
    assert float(att.beta[0, 1]) == 0.0                        # padding contributes nothing


def test_two_sided_fractions_without_advantages():
    alpha = torch.zeros(4)
    beta = torch.tensor([0.5, -0.5, 0.01, -0.01])
    f = clip_fractions(alpha, beta, None, 0.2, 0.2)
    # token 0 clips only as A > 0, token 1 only as A < 0: each counts half.
    assert f["phantom"] == pytest.approx(0.25) and f["clip"] == pytest.approx(0.25)
    g = clip_fractions(alpha, beta, torch.tensor([1.0, 1.0, -1.0, -1.0]), 0.2, 0.2)
    assert g["phantom"] == pytest.approx(0.25)


def test_kl_estimates_against_formulas():
    g = torch.Generator().manual_seed(1)
    mu = -torch.rand(3, 5, generator=g) * 3
    pi = mu + torch.randn(3, 5, generator=g) * 0.3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float)
    k1 = k3 = 0.0
    pd = []
    n = 0
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                d = float(pi[i, t]) - float(mu[i, t])
                k1 += -d
                k3 += math.exp(d) - d - 1
                pd.append(math.exp(float(pi[i, t])) - math.exp(float(mu[i, t])))
                n += 1
    m = kl_estimates(pi, mu, mask)
    assert m["mismatch/kl_k1"] == pytest.approx(k1 / n, rel=1e-5)
    assert m["mismatch/kl_k3"] == pytest.approx(k3 / n, rel=1e-4)
    assert m["mismatch/prob_diff_max"] == pytest.approx(max(pd), abs=1e-6)
    assert m["mismatch/prob_diff_min"] == pytest.approx(min(pd), abs=1e-6)
    assert m["mismatch/prob_diff_abs_mean"] == pytest.approx(sum(map(abs, pd)) / n, abs=1e-7)


def test_exact_kl_against_loops(monkeypatch):
    from parity.logprobs import scoring
    monkeypatch.setattr(scoring, "CHUNK_BYTES", 4 * 7 * 8)
    c = scoring.row_chunk(7)
    g = torch.Generator().manual_seed(2)
    N = 2 * c + 5  # positions in three chunks, the last one short
    mu_logits, pi_logits = torch.randn(N, 7, generator=g), torch.randn(N, 7, generator=g)
    for s in (Sampling(), Sampling(temperature=0.7, top_k=3), Sampling(top_p=0.8)):
        from parity.logprobs import processed_logits
        mu = torch.log_softmax(processed_logits(mu_logits, s), -1)
        got = exact_kl(mu, pi_logits, s)
        assert got.shape == (N,)
        for n in range(N):
            # π as the trainer samples it, but never excluding what μ can sample.
            x = processed_logits(pi_logits[n], s).tolist()
            for v in range(7):
                if math.isfinite(float(mu[n, v])) and not math.isfinite(x[v]):
                    x[v] = float(pi_logits[n, v]) / s.temperature
            z = math.log(sum(math.exp(xv) for xv in x if math.isfinite(xv)))
            ref = sum(math.exp(float(mu[n, v])) * (float(mu[n, v]) - (x[v] - z))
                      for v in range(7) if math.isfinite(float(mu[n, v])))
            assert float(got[n]) == pytest.approx(ref, abs=1e-6)
            assert float(got[n]) >= -1e-9


def _kl_float64(mu_logp: torch.Tensor, pi_logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The direct sum Σ_S μ (log μ − log π) in float64, μ renormalised over its support in
    float64 too: an fp32 log-normaliser over a real vocabulary is off by about 1e-6, more than a
    KL of 1e-7, so the reference must not inherit the engine's."""
    from parity.logprobs import processed_logits
    x = processed_logits(pi_logits, s).double()
    support = torch.isfinite(mu_logp)
    x = torch.where(support & ~torch.isfinite(x), pi_logits.double() / s.temperature, x)
    mu = torch.log_softmax(mu_logp.double(), -1)
    d = (mu - torch.log_softmax(x, -1)).masked_fill(~support, 0.0)
    return (mu.exp() * d).sum(-1)


@pytest.mark.parametrize("s", [Sampling(), Sampling(temperature=0.7, top_p=0.9)],
                         ids=["plain", "top-p"])
def test_exact_kl_at_a_real_vocabulary_against_float64(s):
    """Gaps from bf16-sized down to fp16-against-fp32-sized, at Qwen3's vocabulary: the
    float32 sum holds each KL to 5e-4 of itself, down to KLs of 1e-7."""
    from parity.logprobs import processed_logits
    g = torch.Generator().manual_seed(3)
    V = 151_936
    base = torch.randn(4, V, generator=g) * 3
    mu = torch.log_softmax(processed_logits(base, s), -1)
    for gap in (1e-1, 1e-2, 1e-3):
        pi_logits = base + gap * torch.randn(4, V, generator=g)
        ref = _kl_float64(mu, pi_logits, s)
        got = exact_kl(mu, pi_logits, s)
        assert got.dtype == torch.float64
        assert torch.allclose(got, ref, rtol=5e-4, atol=0), (gap, got, ref)
        assert float(ref.min()) > (1e-7 if gap == 1e-3 else 1e-6)


def test_exact_kl_keeps_a_token_mu_all_but_excludes():
    """μ gives a token e^-90 (below float32's normal range once exponentiated), π gives it half
    its mass: that half is in the KL, through the mass π puts outside μ's support."""
    V = 1000
    pi_logits = torch.zeros(1, V)
    pi_logits[0, 7] = math.log(V - 1)            # π(7) = 1/2
    mu = torch.full((1, V), -math.log(V - 1))
    mu[0, 7] = -90.0
    mu = torch.log_softmax(mu, -1)
    got = float(exact_kl(mu, pi_logits, Sampling())[0])
    assert got == pytest.approx(float(_kl_float64(mu, pi_logits, Sampling())[0]), rel=1e-5)
    assert got == pytest.approx(math.log(2), rel=1e-5)


def _sharp_gap_model():
    """A tiny real Llama whose logits share a large common offset: softmax ignores the offset,
    bf16 rounding of the big logits does not, so β is large enough to test statistically."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 1.0
        m.lm_head.weight.mul_(20)
        m.lm_head.weight[:, 0] = 16.0
    return m


@pytest.mark.e2e
@torch.no_grad()
def test_beta_mean_matches_exact_kl_by_enumeration():
    """Sampling from μ makes E_μ[ℓ_π − ℓ_μ] = −KL(μ‖π): enumerate every completion (vocab 6,
    up to 3 tokens, EOS = 1) for the exact sequence KL, then sample completions from μ and check
    the diagnostics' token mean of β (α = 0 here: μ is the bf16 forward itself)."""
    model = _sharp_gap_model()
    shadow = Shadow(model, "bf16", "fp32")
    prompt, V, L, eos = [2, 3], 6, 3, 1

    def dists(prefixes, m):
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        return torch.log_softmax(m(input_ids=ids).logits[:, -1].float().double(), -1)

    # Walk the tree of prefixes: node log-probs under μ (bf16) and π (fp32).
    table, kl_seq, exp_len, frontier, leaf_mass = {}, 0.0, 0.0, [((), 0.0)], 0.0
    for _ in range(L):
        prefixes = [p for p, _ in frontier]
        lmu, lpi = dists(prefixes, shadow.model), dists(prefixes, model)
        nxt = []
        for (p, logp), mu_row, pi_row in zip(frontier, lmu, lpi):
            table[p] = mu_row
            w = math.exp(logp)
            kl_seq += w * float((mu_row.exp() * (mu_row - pi_row)).sum())
            exp_len += w
            leaf_mass += w * float(mu_row[eos].exp())
            nxt += [(p + (v,), logp + float(mu_row[v])) for v in range(V) if v != eos]
        frontier = nxt
    leaf_mass += sum(math.exp(lp) for _, lp in frontier)
    assert leaf_mass == pytest.approx(1.0, abs=1e-9)  # every completion enumerated exactly once
    assert kl_seq > 0

    # Ancestral sampling from the exact μ table.
    g = torch.Generator().manual_seed(0)
    N = 10000
    comps, lps = [], []
    for _ in range(N):
        p, lp = (), []
        while len(p) < L:
            v = int(torch.multinomial(table[p].exp(), 1, generator=g))
            lp.append(float(table[p][v]))
            p = p + (v,)
            if v == eos:
                break
        comps.append(p)
        lps.append(lp)
    T = L
    ids = torch.zeros(N, T, dtype=torch.long)
    mask, mu = torch.zeros(N, T), torch.zeros(N, T)
    for i, (c, lp) in enumerate(zip(comps, lps)):
        ids[i, :len(c)] = torch.tensor(c)
        mask[i, :len(c)] = 1
        mu[i, :len(c)] = torch.tensor(lp)
    r = Rollout(torch.tensor([prompt] * N), torch.ones(N, 2, dtype=torch.long), ids, mask, mu,
                torch.zeros(N, dtype=torch.bool))
    s = Sampling()
    logp_pi = score(model, r, s)
    logp_s = shadow.logprobs(model, r, s, logp_pi)
    diag = StepDiagnostics()
    att = attribute(logp_pi, logp_s, mu, torch.zeros(N), mask, 0.2, 0.2)
    diag.add(att, logp_pi, mu, torch.zeros(N), mask, first=True)
    m = diag.metrics()

    # The shadow forward reproduces μ: α is the bf16 kernel noise of a longer sequence only.
    assert m["mismatch/alpha_abs_mean"] < 0.02 * m["mismatch/beta_abs_mean"]
    target = -kl_seq / exp_len           # E[Σ_t β] / E[length]: what the token mean estimates
    seq_beta = (att.beta * mask).sum(-1).double()
    lens = mask.sum(-1).double()
    resid = seq_beta - target * lens     # delta-method standard error of a ratio estimator
    se = float(resid.std() / math.sqrt(N) / lens.mean())
    assert abs(m["mismatch/beta_mean"] - target) < 4 * se + 1e-3 * abs(target)
    assert target < -8 * se              # the effect is far beyond noise: the test can fail
    assert m["mismatch/kl_k1"] == pytest.approx(-m["mismatch/beta_mean"]
                                                - m["mismatch/alpha_mean"], rel=1e-6)


@pytest.mark.e2e
@torch.no_grad()
def test_shadow_follows_trainer_weights(tiny_lm):
    """ℓ_s is on the trainer's current weights: after the weights move, the shadow moves too."""
    model = tiny_lm
    shadow = Shadow(model, "bf16", "fp32")
    r = Rollout(torch.tensor([[2, 3]]), torch.ones(1, 2, dtype=torch.long),
                torch.tensor([[4, 5]]), torch.ones(1, 2), torch.zeros(1, 2),
                torch.zeros(1, dtype=torch.bool))
    before = shadow.logprobs(model, r, Sampling())
    model.lm_head.weight[4:6] *= 1.5
    after = shadow.logprobs(model, r, Sampling())
    fp32 = score(model, r, Sampling())
    assert (after - before).abs().max() > 0.05
    assert (after - fp32).abs().max() < (before - fp32).abs().max()
    assert Shadow(model, "fp32", "fp32").identity  # fp32 on both sides: the trainer's own forward


def test_step_metrics_buckets_and_slope():
    """Pooled fractions, buckets by probability and position, and the sequence slope."""
    diag = StepDiagnostics()
    mu = torch.tensor([[-0.05, -3.0, -0.2, 0.0], [-0.05, -3.0, 0.0, 0.0]])
    beta = torch.tensor([[0.3, 0.0, -0.1, 0.0], [0.0, 0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    pi = (mu + beta) * mask
    att = attribute(pi, mu, mu, torch.tensor([1.0, -1.0]), mask, 0.2, 0.2)
    diag.add(att, pi, mu, torch.tensor([1.0, -1.0]), mask, first=True)
    m = diag.metrics()
    assert m["clip/frac"] == pytest.approx(1 / 5)          # only token (0, 0): 0.3 > log 1.2
    assert m["clip/phantom_frac"] == pytest.approx(1 / 5)
    assert m["mismatch/beta_mean"] == pytest.approx(0.4 / 5)
    assert m["beta_by_pos/0-8/tokens"] == 5
    # exp(-3.0 + β) < 0.1: tokens 1 of each row are the low-probability bucket.
    assert m["beta_by_prob/0-0.1/tokens"] == 2
    assert m["beta_by_prob/0-0.1/mean"] == pytest.approx(0.1)
    # Sequence log-ratios 0.2 (3 tokens) and 0.2 (2 tokens): no slope.
    assert m["mismatch/seq_log_ratio_slope"] == pytest.approx(0.0, abs=1e-7)


def test_cluster_standard_errors_by_hand_and_against_a_loop():
    """β's mean and corr(β, A) get standard errors with each completion as one draw. By hand:
    β = (0.3, 0.0, −0.1 | 0.0, 0.2), mean 0.08; residual sums per completion 0.2 − 0.24 = −0.04
    and 0.2 − 0.16 = 0.04, so SE = sqrt(0.0016 + 0.0016) / 5."""
    diag = StepDiagnostics()
    mu = torch.tensor([[-0.05, -3.0, -0.2, 0.0], [-0.05, -3.0, 0.0, 0.0]])
    beta = torch.tensor([[0.3, 0.0, -0.1, 0.0], [0.0, 0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    pi = (mu + beta) * mask
    diag.add(attribute(pi, mu, mu, adv, mask, 0.2, 0.2), pi, mu, adv, mask, first=True)
    m = diag.metrics()
    assert m["mismatch/beta_mean_se"] == pytest.approx(math.sqrt(0.0032) / 5)

    # A second formulation in float64 loops, on random completions over two updates (the second
    # update's rows are other completions): the CR0 sandwich of the standardised regression.
    g = torch.Generator().manual_seed(0)
    diag, rows = StepDiagnostics(), []
    for _ in range(2):
        n, t = 6, 5
        mask = (torch.rand(n, t, generator=g) < 0.8).float()
        mask[:, 0] = 1
        adv = torch.randn(n, generator=g)
        mu = -torch.rand(n, t, generator=g)
        pi = (mu + 0.05 * torch.randn(n, t, generator=g) + 0.02 * adv[:, None]) * mask
        diag.add(attribute(pi, mu, mu, adv, mask, 0.2, 0.2), pi, mu, adv, mask, first=True)
        rows += [[(float(pi[i, j] - mu[i, j]), float(adv[i])) for j in range(t) if mask[i, j]]
                 for i in range(n)]
    m = diag.metrics()
    toks = [x for r in rows for x in r]
    nt = len(toks)
    mb, ma = sum(b for b, _ in toks) / nt, sum(a for _, a in toks) / nt
    sb = math.sqrt(sum((b - mb) ** 2 for b, _ in toks) / nt)
    sa = math.sqrt(sum((a - ma) ** 2 for _, a in toks) / nt)
    r = sum((b - mb) * (a - ma) for b, a in toks) / (nt * sb * sa)
    se_mean = math.sqrt(sum(sum(b - mb for b, _ in c) ** 2 for c in rows)) / nt
    score = [sum(((a - ma) / sa) * ((b - mb) / sb - r * (a - ma) / sa) for b, a in c)
             for c in rows]
    se_r = math.sqrt(sum(x * x for x in score)) / nt
    assert m["mismatch/beta_adv_corr"] == pytest.approx(r, rel=1e-9)
    assert m["mismatch/beta_mean_se"] == pytest.approx(se_mean, rel=1e-6)
    assert m["mismatch/beta_adv_corr_se"] == pytest.approx(se_r, rel=1e-6)
    # Counting tokens as independent would understate the correlation's noise here.
    assert m["mismatch/beta_adv_corr_se"] > math.sqrt((1 - r * r) / nt)


@pytest.mark.e2e
@torch.no_grad()
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_shadow_reproduces_engine_logprobs(text_model, dtype):
    """At θ = θ_old the shadow's full forward recomputes the engine's KV-cache log-probs ℓ_μ:
    the kernel gap |α| is as small in fp16 (emulated on CPU) as in bf16. Batches of one and two
    prompts make decode steps whose products have 1-2 rows, where the old fp16 emulation's fp32
    GEMM summed in another order than in the shadow's many-row products: its gap here was 6e-5
    per token, against 1e-7 for bf16."""
    from parity.engines.hf import HFEngine
    from parity.models.loading import load_policy
    from parity.tasks.data import text_prompts
    torch.set_num_threads(1)
    model, tok = load_policy(text_model)
    prompts = [tok(p)["input_ids"] for p in text_prompts(8, seed=0)]
    engine = HFEngine(model, dtype, tok.eos_token_id, tok.pad_token_id)
    shadow = Shadow(model, dtype, "fp32")
    s, g = Sampling(), torch.Generator().manual_seed(0)
    gaps = []
    for batch in [[p] for p in prompts] + [prompts[:2], prompts[2:4]]:
        r = engine.generate(batch, 24, s, g)
        m = r.completion_mask > 0
        gaps.append((shadow.logprobs(model, r, s) - r.engine_logprobs)[m].abs())
    gap = torch.cat(gaps)
    assert gap.numel() > 100
    # With the same arithmetic on both sides, what is left are fp32 reductions over different
    # lengths (the engine's softmax spans its static cache, the shadow's the sequence): 1.1e-7
    # per token measured, in bf16 and in fp16 alike. Products whose fp16 results land an ulp
    # apart (the old emulation) measured 6e-5. The bound is 9x the first, 60x under the second.
    assert float(gap.mean()) < 1e-6, float(gap.mean())
