"""The hf engine: sampling distribution, log-probs, padding, and its agreement with the trainer."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity.engines.hf import HFEngine
from parity.logprobs import Sampling, processed_logits
from parity.models.forward import score

PROMPT = [3, 4, 5]


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 1e-4 (z = 3.72)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.e2e
@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.6), Sampling(1.3, top_k=5),
                               Sampling(1.0, top_p=0.7), Sampling(0.8, top_p=0.9, top_k=8),
                               Sampling(0.9, min_p=0.3), Sampling(1.0, repetition_penalty=4.0),
                               Sampling(0.8, top_k=10, min_p=0.1, repetition_penalty=0.5)])
def test_sampling_matches_exact_softmax(tiny_lm, s):
    n = 40_000
    engine = HFEngine(tiny_lm, "fp32", eos_id=1, pad_id=0)
    r = engine.generate([PROMPT] * n, 1, s, torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT])).logits[0, -1].double()
    # The exact sampling distribution, written independently: float64, explicit sort; the
    # prompt's tokens are the ones a repetition penalty counts before the first new token.
    for t in set(PROMPT):
        logits[t] = logits[t] / s.repetition_penalty if logits[t] > 0 else \
            logits[t] * s.repetition_penalty
    z = logits / s.temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if s.top_k:
        keep &= z >= torch.sort(z, descending=True).values[s.top_k - 1]
    if s.top_p < 1:
        p = torch.where(keep, z, -torch.inf).softmax(-1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        kept = torch.zeros_like(keep)
        kept[order[before < s.top_p]] = True
        keep &= kept
    if s.min_p:
        p = torch.where(keep, z, -torch.inf).softmax(-1)
        keep &= p >= s.min_p * p.max()
    p = torch.where(keep, z, -torch.inf).softmax(-1)
    counts = torch.bincount(r.completion_ids[:, 0], minlength=16).double()
    assert counts[~keep].sum() == 0, "a truncated token was sampled"
    expected = p[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(int(keep.sum()) - 1)
    # ℓ_μ is the log-prob under the distribution actually sampled from.
    lp = torch.log(p)[r.completion_ids[:, 0]]
    assert torch.allclose(r.engine_logprobs[:, 0].double(), lp, atol=1e-5)


@pytest.mark.e2e
def test_temperature_is_not_ignored(tiny_lm):
    # The same chi-square check must reject a distribution at the wrong temperature.
    n = 40_000
    engine = HFEngine(tiny_lm, "fp32", eos_id=1, pad_id=0)
    r = engine.generate([PROMPT] * n, 1, Sampling(0.5), torch.Generator().manual_seed(1))
    with torch.no_grad():
        p = tiny_lm(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)  # T = 1
    counts = torch.bincount(r.completion_ids[:, 0], minlength=16).double()
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 > chi2_critical(15)


@pytest.mark.e2e
def test_eos_and_padding(tiny_lm):
    engine = HFEngine(tiny_lm, "fp32", eos_id=1, pad_id=0)
    prompts = [[2, 3], [4, 5, 6, 7, 8], [9]] * 50
    r = engine.generate(prompts, 12, Sampling(1.0), torch.Generator().manual_seed(0))
    assert r.finished.any() and (~r.finished).any()
    for i in range(len(prompts)):
        n = int(r.completion_mask[i].sum())
        row = r.completion_ids[i]
        assert r.completion_mask[i, :n].all() and not r.completion_mask[i, n:].any()
        if r.finished[i]:
            assert row[n - 1] == 1 and (row[:n - 1] != 1).all()
        else:
            assert n == 12 and (row != 1).all()
        assert (row[n:] == 0).all() and (r.engine_logprobs[i, n:] == 0).all()
        assert (r.engine_logprobs[i, :n] < 0).all()
    # left padding: each prompt is stored right-aligned with a mask
    assert r.prompt_mask[0].tolist() == [0, 0, 0, 1, 1]
    assert r.prompt_ids[0, -2:].tolist() == [2, 3]


@pytest.mark.e2e
def test_engine_scoring_follows_the_master_across_optimizer_steps(tiny_lm):
    """The engine's own scoring (the engine-scored shadow) casts the master once per optimizer
    step, and after a step scores the stepped weights: the same numbers as an engine built on
    them, and not the old ones."""
    import copy
    master = copy.deepcopy(tiny_lm).float()
    engine = HFEngine(master, "bf16", eos_id=1, pad_id=0)
    r = engine.generate([[2, 3], [4, 5, 6]] * 4, 8, Sampling(), torch.Generator().manual_seed(0))
    first = engine.score(master, r, Sampling())
    assert torch.equal(first, engine.score(master, r, Sampling()))
    opt = torch.optim.SGD(master.parameters(), lr=0.5)
    (-score(master, r, Sampling()) * r.completion_mask).sum().backward()
    opt.step()
    after = engine.score(master, r, Sampling())
    fresh = HFEngine(master, "bf16", eos_id=1, pad_id=0).score(master, r, Sampling())
    assert torch.equal(after, fresh)
    assert ((after - first).abs() * r.completion_mask).max() > 1e-2


def test_processed_logits_keeps_the_sampled_token():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    s = Sampling(1.0, top_k=2)
    assert torch.isinf(processed_logits(logits, s)[0, 3])
    kept = processed_logits(logits, s, keep=torch.tensor([3]))
    assert torch.isfinite(kept[0, 3]) and torch.isinf(kept[0, 2])


# transformers' own processors, in the order its generate applies them
def _transformers_processors(s: Sampling):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    out = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    out.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        out.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1:
        out.append(TopPLogitsWarper(s.top_p))
    if s.min_p:
        out.append(MinPLogitsWarper(s.min_p))
    return out


SAMPLINGS = [Sampling(1.0, repetition_penalty=1.3), Sampling(0.7, min_p=0.1),
             Sampling(1.2, top_p=0.8, repetition_penalty=1.5),
             Sampling(0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=0.8)]


@pytest.mark.parametrize("s", SAMPLINGS)
def test_processed_logits_are_transformers_processors(s):
    """Each row's history (an unpadded prompt and the tokens sampled so far) through
    transformers' own processors gives the distribution `processed_logits` gives with that
    history as `seen`."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=g) * 3
    history = torch.randint(0, 64, (8, 12), generator=g)
    seen = torch.zeros(8, 64, dtype=torch.bool).scatter(1, history, True)
    want = _transformers_processors(s)(history, logits.clone()).log_softmax(-1)
    got = processed_logits(logits, s, seen=seen).log_softmax(-1)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got).any() == s.truncates
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-5)


@pytest.mark.parametrize("s", [Sampling(), *SAMPLINGS])
def test_logprobs_without_gradient_run_in_chunks_to_the_same_values(s, monkeypatch):
    """Without gradient `logprobs_from_logits` takes a few positions at a time: the same
    log-probs as the whole [B, T, V] tensor at once, and as a float64 sum. At the default chunk
    (a position per thread at least) bit for bit; forced to chunks of 3 positions, within
    float32 rounding."""
    from parity.logprobs import logprobs_from_logits, scoring, seen_before
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 40, 5000
    logits = (torch.randn(B, T + 1, V, generator=g) * 3).bfloat16()[:, :T]  # a model's slice
    prompt = torch.randint(0, V, (B, 5), generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    seen = seen_before(prompt, torch.ones_like(prompt), tokens, torch.ones(B, T), V)
    whole = scoring._logprobs(logits, tokens, s, True, seen)
    with torch.no_grad():
        assert torch.equal(logprobs_from_logits(logits, tokens, s, seen=seen), whole)
        assert torch.equal(logprobs_from_logits(logits[0], tokens[0], s, seen=seen[0]), whole[0])
        monkeypatch.setattr(scoring, "CHUNK_BYTES", 3 * 4 * V)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
        assert scoring.row_chunk(V) == 3
        chunked = logprobs_from_logits(logits, tokens, s, seen=seen)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    x = processed_logits(logits, s, keep=tokens, seen=seen).double()
    want = x.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(x, -1)
    torch.testing.assert_close(chunked.double(), want, rtol=0, atol=2e-5)


def test_seen_before_counts_the_prompt_and_the_completion_so_far():
    from parity.logprobs import seen_before
    prompt = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 3]])
    pmask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    comp = torch.tensor([[2, 5, 1, 0], [4, 4, 2, 1]])
    cmask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    seen = seen_before(prompt, pmask, comp, cmask, vocab=10)
    for b in range(2):
        for t in range(4):
            want = {int(x) for x, m in zip(prompt[b], pmask[b]) if m} | set(comp[b, :t].tolist())
            assert set(seen[b, t].nonzero().flatten().tolist()) == want, (b, t)


@pytest.mark.e2e
@pytest.mark.parametrize("s", [Sampling(0.9, min_p=0.1, repetition_penalty=1.5),
                               Sampling(1.0, top_k=8, repetition_penalty=0.7)])
def test_engine_logprobs_are_transformers_processors_in_float64(tiny_lm, s):
    """Several tokens per row from left-padded prompts: each ℓ_μ equals a float64 forward of
    the unpadded row, its logits put through transformers' processors with the row's history
    (the pad token 0 is also a token the model samples: padding must not count as seen)."""
    import copy
    engine = HFEngine(tiny_lm, "fp32", eos_id=1, pad_id=0)
    prompts = [[2, 3], [4, 5, 6, 7, 0], [9]] * 20
    r = engine.generate(prompts, 6, s, torch.Generator().manual_seed(0))
    ref = copy.deepcopy(tiny_lm).double()
    procs = _transformers_processors(s)
    n = 0
    for i, p in enumerate(prompts):
        c = r.completions()[i]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = ref(ids).logits[0]
        for t, tok in enumerate(c):
            x = procs(ids[:, :len(p) + t], logits[None, len(p) + t - 1].clone())
            want = float(x.log_softmax(-1)[0, tok])
            assert r.engine_logprobs[i, t].item() == pytest.approx(want, abs=1e-5), (i, t)
            n += 1
    assert n > 150


@pytest.mark.e2e
@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.7, top_p=0.9, top_k=20),
                               Sampling(0.8, top_k=20, min_p=0.05, repetition_penalty=1.3)])
def test_engine_logprobs_match_trainer_forward_fp32_and_differ_in_bf16(text_model, s):
    """With an fp32 engine the KV-cache log-probs equal a full trainer forward within 1e-4;
    a bf16 engine on the same weights disagrees: that gap is β's raw material."""
    model = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(text_model)
    from parity.tasks.data import text_prompts
    prompts = [tok(p)["input_ids"] for p in text_prompts(16, seed=0)]
    diffs = {}
    for dtype in ("fp32", "bf16"):
        engine = HFEngine(model, dtype, tok.eos_token_id, tok.pad_token_id)
        r = engine.generate(prompts * 2, 24, s, torch.Generator().manual_seed(0))
        with torch.no_grad():
            lp = score(model, r, s)
        m = r.completion_mask > 0
        assert m.sum() > 100
        diffs[dtype] = (lp - r.engine_logprobs)[m].abs()
    assert diffs["fp32"].max() < 1e-4
    assert diffs["bf16"].mean() > 1e-3
    assert diffs["bf16"].max() > 1e-2


def test_inverse_cdf_sampler_draws_each_row_from_its_own_distribution():
    """`sample_rows` against known distributions: zero-probability tokens (top-k/top-p cuts,
    -inf log-probs) are never drawn, and the frequencies pass a chi-square test per row."""
    from parity.engines import sample_rows, uniforms
    p = torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0],
                      [0.0, 0.0, 0.0, 0.1, 0.9],
                      [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    logp = p.log().float()
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = torch.stack([sample_rows(logp, uniforms(g, logp.shape[0])) for _ in range(n)])  # [n, 3]
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        assert counts[p[row] == 0].sum() == 0
        keep = p[row] > 0
        expected = p[row][keep] * n
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < chi2_critical(int(keep.sum()) - 1)


def _attention_reference(q, k, v, mask, scaling):
    """softmax(q·kᵀ·scaling + mask)·v in float64, one query head at a time, each on the
    key/value head repeat_kv gives it (head h reads key/value head h // groups)."""
    B, H, Q, d = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, Q, H, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h].double() @ k[b, h // g].double().T * scaling + mask[b, 0].double()
            out[b, :, h] = torch.softmax(s, -1) @ v[b, h // g].double()
    return out


def test_engine_attention_against_a_float64_reference():
    from parity.models.attention import engine_attention
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    B, H, kv, d, L = 2, 6, 2, 8, 9   # grouped-query: 3 query heads per key/value head
    neg = torch.finfo(torch.float32).min
    k, v = torch.randn(B, kv, L, d), torch.randn(B, kv, L, d)
    # A decode step over a static cache filled to 5 of its 9 positions, row 1 left-padded by 2:
    # positions past the fill are masked as the cache's mask masks them, and not read at all.
    q = torch.randn(B, H, 1, d)
    mask = torch.zeros(B, 1, 1, L)
    mask[..., 5:] = neg
    mask[1, ..., :2] = neg
    got, _ = engine_attention(module, q, k, v, mask, 0.3, parity_kv_len=5)
    assert got.shape == (B, 1, H, d)
    torch.testing.assert_close(got.double(), _attention_reference(q, k[:, :, :5], v[:, :, :5],
                                                                 mask[..., :5], 0.3),
                               atol=1e-6, rtol=1e-6)
    # A full forward (the shadow's): every query position, causal mask, no fill given.
    q = torch.randn(B, H, L, d)
    causal = torch.full((L, L), neg).triu(1).expand(B, 1, L, L)
    got, _ = engine_attention(module, q, k, v, causal, d ** -0.5)
    torch.testing.assert_close(got.double(), _attention_reference(q, k, v, causal, d ** -0.5),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.e2e
def test_the_hf_engine_records_the_first_positions_of_a_row_only(text_model, monkeypatch):
    """With a bound of 3 positions a row, the exact KL's rows hold what an unbounded recording
    holds there, in pieces too, and the trainer's exact KL of them is the unbounded one's over
    those positions."""
    from parity.diagnostics import exact_kl_of_rows
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling, scoring
    from parity.models.forward import score_full
    from parity.models.loading import load_policy
    model, tok = load_policy(text_model)
    engine = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(t)["input_ids"] for t in ("the cat", "once upon", "a", "why is")]
    s = Sampling(top_p=0.9)
    run = lambda **kw: engine.generate(prompts, 10, s, torch.Generator().manual_seed(4),
                                       record_rows=[0, 3], **kw)
    whole = run()
    monkeypatch.setattr(scoring, "RECORDED_BYTES_PER_ROW", 3 * 4 * model.config.vocab_size)
    for r in (run(), run(max_batch=2)):
        assert r.completions() == whole.completions()
        assert r.dists.shape[1] == 3 and torch.equal(r.dists, whole.dists[:, :3])
    with torch.no_grad():
        sc = score_full(model, r, s, keep_logits=[0, 3])
    assert sc.logits.shape[1] == 3
    mask = r.completion_mask[[0, 3]]
    short = exact_kl_of_rows(r, sc.logits, [0, 3], mask, s)
    monkeypatch.undo()
    with torch.no_grad():
        full = score_full(model, whole, s, keep_logits=[0, 3])
    long = exact_kl_of_rows(whole, full.logits, [0, 3], mask, s)
    n = mask.sum(-1).long().tolist()
    assert short.numel() == sum(min(k, 3) for k in n)
    torch.testing.assert_close(short, torch.cat([long[:min(n[0], 3)],
                                                 long[n[0]:n[0] + min(n[1], 3)]]))
