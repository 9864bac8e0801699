"""Memory settings change how a step is computed, never what it computes: micro-batches with
gradient accumulation (by rows or by a token budget), chunked log-probs and gradient
checkpointing give the unbatched step's weights and metrics to float rounding, for every
objective and loss aggregation.

Updates use plain SGD without gradient clipping: the weight change is then the gradient itself,
so a micro-batch loss scaled wrongly (a sum where a mean belongs, a piece's mean taken for the
minibatch's) shows up in proportion. Adam would normalise such an error away.
"""

from __future__ import annotations

import math

import pytest
import torch

from parity import metric_names as mn
from parity.config import RECIPES, make_config
from parity.models.forward import pieces, trimmed
from parity.trainer import train

BASE = dict(task="neg-length", model="text-xs", recipe="fp32", steps=2, prompts_per_step=4,
            samples_per_prompt=4, max_new_tokens=12, minibatches=2, optimizer="sgd", lr=0.05,
            max_grad_norm=0.0, kl_exact_rows=4, progress=False, report_to="none", threads=1,
            seed=3)

CASES = {
    "ppo-clip seq-mean": {},
    "ppo-clip token-mean": {"loss_agg": "token-mean"},
    "ppo-clip token-sum": {"loss_agg": "token-sum"},
    "bf16-engine": {"recipe": "bf16-engine"},
    "bf16-shadow": {"recipe": "bf16-shadow"},
    "tis (recompute)": {"recipe": "tis"},
    "gspo": {"objective": "gspo"},
    "pg-is": {"objective": "pg-is"},
    "ppo-value": {"objective": "ppo-value"},
    "online-dpo": {"objective": "online-dpo"},
}


class Watch:
    """Keeps the run's master model and the shape of every forward with gradient."""

    def __init__(self):
        self.model, self.start, self.shapes = None, None, []

    def __call__(self, model):
        self.model = model
        self.start = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def seen(module, args, kwargs):
            if torch.is_grad_enabled():
                self.shapes.append(tuple(kwargs["input_ids"].shape))
        model.register_forward_pre_hook(seen, with_kwargs=True)

    def delta(self) -> torch.Tensor:
        now = self.model.state_dict()
        return torch.cat([(now[k] - v).flatten() for k, v in self.start.items()])


def _run(tmp_path, name, **kw):
    w = Watch()
    cfg = make_config({**BASE, **kw, "out": str(tmp_path / name)}).validate()
    run = train(cfg, on_model=w)
    rows = [__import__("json").loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return w, rows


# How far a token's β may move between two batchings of one step (the root mean square over the
# step's tokens): fp32 on both sides leaves the mismatch figures (β and its breakdowns) at
# rounding noise (~1e-6 a sequence) that other batch shapes change; where there is a mismatch
# (bf16) it is ~1e-2, and on a CPU whose bf16 products depend on the batch's shape a shadow's β
# moves by up to 1e-5 with the micro-batch.
BETA_SHIFT = 3e-5


def _same_metrics(a, b, rel):
    timing = ("time/", "throughput/", "async/wait_s")
    for x, y in zip(a, b, strict=True):
        assert ({k for k in x if not k.startswith(timing)}
                == {k for k in y if not k.startswith(timing)})
        for k, v in x.items():
            if k.startswith(timing) or not isinstance(v, float):
                assert v == y[k] or k.startswith(timing), (k, v, y[k])
                continue
            if k in (mn.BETA_ADV_CORR, mn.BETA_ADV_CORR_SE):
                bound = _correlation_shift(x, y)
                assert abs(v - y[k]) <= bound, (x["step"], k, v, y[k], bound)
                continue
            tol = BETA_SHIFT if k.startswith(("mismatch/", "beta_by_")) else 1e-6
            assert math.isclose(v, y[k], rel_tol=rel, abs_tol=tol), (x["step"], k, v, y[k])


def _correlation_shift(x: dict, y: dict) -> float:
    """How far corr(β, A) and its standard error may move when β moves by BETA_SHIFT a token.
    With x̂, ŷ the unit vectors of the centred advantages and β over the step's N tokens,
    r = <x̂, ŷ> and its SE is |S(x̂ ⊙ (ŷ - r x̂))|, S the sums over each completion
    (parity/diagnostics.py). Cauchy-Schwarz within each completion gives |S(x̂ ⊙ w)| <= |w|, and
    ŷ - r x̂ changes by ŷ's change projected off x̂: r and its SE move by at most ŷ's change,
    2|Δβ|/|β - mean β| with either run's β, so 2 BETA_SHIFT/σ_β·sqrt(N/(N-1)) with the larger
    σ_β (N >= 16: a step's 16 completions). In proportion to β's spread, not to r: a
    correlation of rounding noise is ill-conditioned. fp16 on both sides has σ_β 1e-3 and a
    bound of 0.06. Its second minibatch is scored on weights the chunks left apart (each chunk's
    head gradient rounds to fp16 on its own: lm_head 1.4e-6 apart after an update), and β moves
    by 9.5e-6 a token: r by 1e-5 (-0.02207 whole, -0.02206 in chunks of 5) on a CPU with AMX,
    by 0.004 (0.12225, 0.11812), 3.5% of r, on one without AVX-512."""
    return 2 * BETA_SHIFT / max(x[mn.BETA_STD], y[mn.BETA_STD]) * math.sqrt(16 / 15)


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_micro_batches_give_the_unbatched_step(text_model, tmp_path, case):
    kw = CASES[case]
    whole, m0 = _run(tmp_path, "whole", **kw)
    # online-dpo pairs completions of a prompt: its micro-batches hold whole groups.
    rows = 4 if kw.get("objective") == "online-dpo" else 3
    split, m1 = _run(tmp_path, "split", micro_batch=rows, **kw)
    assert max(s[0] for s in split.shapes) <= rows < max(s[0] for s in whole.shapes)
    d0, d1 = whole.delta(), split.delta()
    assert d0.norm() > 1e-3  # the step moved the weights: there is something to compare
    assert (d1 - d0).norm() <= _step_tolerance(kw) * d0.norm()
    _same_metrics(*_comparable(m0, m1, kw), 2e-3)


def _step_tolerance(kw) -> float:
    """How far two batchings' weight changes may part, relative to the change. A shadow
    recomputes ℓ_s in bf16 in every micro-batch, and on a CPU whose bf16 products depend on the
    batch's shape (one without AMX) some ℓ_s round the other way: 4e-4 measured there. Either
    bound sits far below what a wrongly scaled micro-batch loss gives (a factor of its share)."""
    return 2e-3 if RECIPES[kw.get("recipe", "fp32")].settings["ratio_source"] == "shadow" else 2e-4


def _comparable(a, b, kw):
    """Both runs' steps whose metrics must agree to float rounding. After the first update a
    bf16 engine or shadow holds the bf16 cast of weights that differ in their last fp32 bits,
    and some casts round the other way: later bf16 figures differ as any two runs' would."""
    n = None if kw.get("recipe", "fp32") == "fp32" else 1
    return a[:n], b[:n]


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["ppo-clip token-mean", "online-dpo"])
def test_a_token_budget_packs_whole_groups_within_it(text_model, tmp_path, case):
    kw = CASES[case]
    whole, m0 = _run(tmp_path, "whole", **kw)
    budget = 80
    packed, m1 = _run(tmp_path, "packed", micro_batch_tokens=budget, **kw)
    group = 4 if kw.get("objective") == "online-dpo" else 1
    # Each forward within the budget (a single group over it runs alone): trimmed to its rows.
    assert all(b * L <= budget or b == group for b, L in packed.shapes)
    assert len(packed.shapes) > len(whole.shapes)
    d0, d1 = whole.delta(), packed.delta()
    assert (d1 - d0).norm() <= 2e-4 * d0.norm()
    _same_metrics(*_comparable(m0, m1, kw), 2e-3)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["bf16-engine, checkpointing", "fp16 loss scaling", "lora",
                                  "top-p, top-k"])
def test_chunked_logprobs_give_the_whole_logits_step(text_model, tmp_path, case):
    """The default chunks (and chunks of 5 tokens) against one [tokens, vocabulary] tensor per
    forward (logprob_chunk=-1): the same update and metrics, with fp16's dynamic loss scaling,
    LoRA adapters, gradient checkpointing and a sampling distribution a chunk must truncate."""
    kw = {"bf16-engine, checkpointing": {"recipe": "bf16-engine",
                                         "gradient_checkpointing": True},
          "fp16 loss scaling": {"recipe": "fp16"},
          "lora": {"lora_rank": 4, "lr": 0.5},
          "top-p, top-k": {"top_k": 40, "top_p": 0.9,
                                        "temperature": 0.8}}[case]
    # Under fp16 autocast each chunk's head gradient is an fp16 product rounded on its own
    # (fp16's relative rounding is 4.9e-4) before the chunks are summed in fp32.
    rel = 2e-3 if case.startswith("fp16") else 2e-4
    if kw.get("recipe") in ("bf16-engine", "fp16"):
        # One step of one update. A later forward sees weights the chunks left apart in their
        # last fp32 bits (fp16 chunks of 5: 1.5e-4 of the update apart on a CPU without AMX),
        # and in low precision a weight that far apart can round the other way: one fp16 ulp,
        # 4.9e-4 of a logit of ~10, moves that token's ℓ by ~5e-3, a bucket mean of ~100
        # tokens by ~5e-5, over BETA_SHIFT (3.3e-5 seen on a CPU with AMX, a second minibatch's
        # beta_by_pos/8-32). A second step samples from such a cast: ℓ_μ, a clip or a draw moves.
        kw = {**kw, "steps": 1, "minibatches": 1}
    whole, m0 = _run(tmp_path, "whole", logprob_chunk=-1, **kw)
    for name, chunk in (("default", 0), ("five", 5)):
        chunked, m1 = _run(tmp_path, name, logprob_chunk=chunk, **kw)
        d0, d1 = whole.delta(), chunked.delta()
        assert d0.norm() > 0
        assert (d1 - d0).norm() <= rel * d0.norm(), (name, float((d1 - d0).norm() / d0.norm()))
        _same_metrics(*_comparable(m0, m1, kw), 2e-3)


@pytest.mark.e2e
def test_chunked_scoring_never_makes_the_whole_vocabulary_tensor(text_model):
    """The LM head sees at most `chunk` tokens of a forward with gradient at a time, in the
    forward and in the backward, and the default never the whole batch's; both give the log-probs
    of the model's own whole logits."""
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models.forward import WHOLE, score_full
    from parity.models.loading import load_policy
    model, tok = load_policy(text_model)
    r = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        [tok("the cat")["input_ids"]] * 3, 10, Sampling(), torch.Generator().manual_seed(0))
    seen = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, i, o: seen.append(math.prod(o.shape[:-1])))
    ref = score_full(model, r, Sampling(), chunk=WHOLE).logp
    assert max(seen) == 3 * (r.completion_ids.shape[1] + 1)   # the whole path: all at once
    seen.clear()
    logp = score_full(model, r, Sampling(), chunk=4).logp
    logp.sum().backward()  # recomputes each chunk's logits in the backward
    tokens = int(r.completion_mask.sum())
    assert max(seen) <= 4
    assert sum(seen) == 2 * tokens      # each valid token once forward, once in the backward
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    seen.clear()
    torch.testing.assert_close(score_full(model, r, Sampling()).logp, ref, atol=1e-5, rtol=0)
    assert sum(seen) == tokens          # the default: no padding position is ever projected


def test_pieces_cover_the_batch_in_order():
    from parity.logprobs import Rollout
    B, P, T = 10, 3, 6
    clen = torch.tensor([6, 1, 2, 6, 3, 3, 1, 1, 5, 2])
    r = Rollout(torch.ones(B, P, dtype=torch.long), torch.ones(B, P, dtype=torch.long),
                torch.ones(B, T, dtype=torch.long),
                (torch.arange(T)[None] < clen[:, None]).float(), torch.zeros(B, T),
                torch.zeros(B, dtype=torch.bool))
    for kw in ({"rows": 3}, {"tokens": 20}, {"rows": 4, "tokens": 30, "group": 2},
               {"rows": 2, "group": 2, "count": 7}):
        sl = pieces(r, **kw)
        assert [i for s in sl for i in range(s.start, s.stop)] == list(range(B))
        group = kw.get("group", 1)
        assert all(s.start % group == 0 for s in sl)
        for s in sl:
            n = s.stop - s.start
            t = trimmed(r.select(s))
            cost = n * (t.prompt_ids.shape[1] + t.completion_ids.shape[1])
            assert n <= kw.get("rows", B) or n == group
            assert cost <= kw.get("tokens", 10 ** 9) or n == group
        if "count" in kw:
            assert len(sl) == kw["count"] or all(s.stop - s.start == group for s in sl)


@pytest.mark.e2e
def test_a_run_too_big_for_memory_says_which_setting_to_change(text_model, monkeypatch):
    import re

    from parity.errors import ParityError
    from parity.models.loading import load_policy
    from parity.runs import memory
    cfg = make_config({**BASE, "prompts_per_step": 16, "samples_per_prompt": 8,
                       "max_new_tokens": 64, "minibatches": 1}).validate()
    model, _ = load_policy(text_model)
    e = memory.estimate(cfg, model, 20)
    assert e.rows == 128
    free = e.weights + e.forward / 3
    monkeypatch.setattr(memory, "available", lambda device=None: free)
    msg = memory.check(cfg, model, 20)
    n = int(re.search(r"--micro-batch (\d+)", msg).group(1))
    assert memory.estimate(cfg, model, 20, micro_batch=n).total <= free < \
        memory.estimate(cfg, model, 20, micro_batch=2 * n).total / 0.9
    monkeypatch.setattr(memory, "available", lambda device=None: e.total)
    assert memory.check(cfg, model, 20) is None
    monkeypatch.setattr(memory, "available", lambda device=None: e.weights / 2)
    with pytest.raises(ParityError, match="weights, gradients and optimizer state need"):
        memory.check(cfg, model, 20)


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_engine_samples_in_pieces_with_the_same_results(text_model, dtype):
    """A bounded engine batch decodes the same completions with the same ℓ_μ and recorded
    distributions, and leaves the generator where the whole batch leaves it (the next step's
    rollout depends on it)."""
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models.loading import load_policy
    model, tok = load_policy(text_model)
    eng = HFEngine(model, dtype, tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(p)["input_ids"] for p in ("the cat", "a", "import os and then", "x y")] * 3
    out = {}
    for n in (0, 5, 1):
        g = torch.Generator().manual_seed(7)
        r = eng.generate(prompts, 60, Sampling(), g, record_rows=[1, 6, 11], max_batch=n)
        out[n] = r, torch.rand(4, generator=g)
    (r0, after0) = out[0]
    # fp32 products give a row the same bits in any batch; bf16 ones may not (on a CPU whose
    # bf16 kernels depend on the batch's shape): ℓ_μ within bf16's rounding, as in
    # `_same_until_a_draw_falls_the_other_way`, even where every draw lands the same.
    atol = 0.05 if dtype == "bf16" else 1e-5
    for n in (5, 1):
        r, after = out[n]
        if dtype == "bf16" and not torch.equal(r.completion_ids, r0.completion_ids):
            _same_until_a_draw_falls_the_other_way(r, r0)
            continue
        assert torch.equal(r.completion_ids, r0.completion_ids)
        assert torch.equal(r.completion_mask, r0.completion_mask)
        torch.testing.assert_close(r.engine_logprobs, r0.engine_logprobs, atol=atol, rtol=0)
        assert r.dist_rows.tolist() == [1, 6, 11]
        valid = r0.completion_mask[[1, 6, 11]] > 0  # past a row's end its distribution is unused
        torch.testing.assert_close(r.dists[valid], r0.dists[valid], atol=atol, rtol=0)
        assert torch.equal(after, after0)
    assert r0.completion_mask.sum(-1).float().std() > 0  # rows of different lengths were cut


def _same_until_a_draw_falls_the_other_way(r, r0):
    """On a CPU whose bf16 products depend on the batch's shape (one without AMX), a row decoded
    in a smaller batch gets logits that differ in their last bf16 bit, and now and then a draw
    lands on the other side of a boundary between two tokens. Every row then agrees with the
    whole batch's up to its first differing token, with ℓ_μ within bf16's rounding there, and
    such flips stay rare."""
    flipped = 0
    for a, b, ma, mb, la, lb in zip(r.completion_ids, r0.completion_ids, r.completion_mask,
                                    r0.completion_mask, r.engine_logprobs, r0.engine_logprobs):
        n = int(min(ma.sum(), mb.sum()))
        differ = (a[:n] != b[:n]).nonzero()
        first = int(differ[0]) if len(differ) else n
        flipped += first < n or int(ma.sum()) != int(mb.sum())
        torch.testing.assert_close(la[:first], lb[:first], atol=0.05, rtol=0)
    assert flipped <= len(r0.completion_ids) // 4, f"{flipped} rows decoded differently"


@pytest.mark.e2e
def test_a_bounded_engine_batch_trains_the_same_run(text_model, tmp_path):
    whole, m0 = _run(tmp_path, "whole")
    bounded, m1 = _run(tmp_path, "bounded", rollout_batch=5)
    assert [m["completion/len_mean"] for m in m0] == [m["completion/len_mean"] for m in m1]
    assert (bounded.delta() - whole.delta()).norm() <= 2e-4 * whole.delta().norm()
    _same_metrics(m0, m1, 2e-3)


@pytest.mark.e2e
def test_settings_that_cannot_hold_are_refused(text_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from parity.errors import ParityError
    from parity.logprobs import Rollout, Sampling
    from parity.models.forward import score_full
    with pytest.raises(ParityError, match="micro_batch=3: objective=online-dpo pairs completions "
                                          "of one prompt"):
        make_config({**BASE, "objective": "online-dpo", "micro_batch": 3}).validate()
    capped = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          final_logit_softcapping=30.0))
    r = Rollout(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3), torch.zeros(1, 3),
                torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ParityError, match="transforms its logits after the output projection"):
        score_full(capped, r, Sampling(), chunk=2)
    # by default it is scored from its own logits, as with logprob_chunk=-1
    assert torch.equal(score_full(capped, r, Sampling()).logp,
                       score_full(capped, r, Sampling(), chunk=-1).logp)


@pytest.mark.e2e
def test_arith_refuses_a_model_that_cannot_do_it_after_its_first_problems(text_model, tmp_path):
    """An untrained model never answers `a+b=` with the sum alone: the calibration stops after
    its first batch of samples instead of sampling all 512 problems 40 times."""
    import re

    from transformers import AutoConfig, AutoModelForCausalLM

    from parity.errors import ParityError
    from parity.models.loading import load_policy
    from parity.tasks import ARITH_CANDIDATES, ARITH_PROBE, arith_rows
    from parity.testbed import solve_rates
    _, tok = load_policy(text_model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(text_model)).eval()
    model.save_pretrained(tmp_path / "untrained")
    with pytest.raises(ParityError, match=r"solved none of the first \d+ problems") as e:
        arith_rows(tmp_path / "untrained", model, tok, 0, 1.0, solve_rates, cache=tmp_path,
                   progress=False)
    n = int(re.search(r"first (\d+) problems", str(e.value)).group(1))
    assert ARITH_PROBE <= n < ARITH_CANDIDATES
    assert not list(tmp_path.glob("tasks/*.json"))  # nothing cached for a refused model


@pytest.mark.e2e
def test_the_memory_estimate_follows_the_logprob_chunks(text_model, monkeypatch):
    """The check before a run prices the logits the scoring holds at once: by default a chunk's
    and those kept for the backward, every position's with logprob_chunk=-1, and to such a run
    it suggests the chunks first."""
    import dataclasses

    from parity.logprobs import head_chunk, kept_tokens, scoring
    from parity.models.loading import load_policy
    from parity.runs import memory
    cfg = make_config({**BASE, "prompts_per_step": 64, "samples_per_prompt": 8,
                       "max_new_tokens": 256, "minibatches": 1}).validate()
    whole = dataclasses.replace(cfg, logprob_chunk=-1)
    model, _ = load_policy(text_model)
    V = model.config.vocab_size
    # kept logits of 4,096 tokens, as a large vocabulary's budget keeps a fraction of 131,072
    monkeypatch.setattr(scoring, "KEPT_LOGITS_BYTES", 4096 * V * 4)
    chunked, e = memory.estimate(cfg, model, 20), memory.estimate(whole, model, 20)
    assert head_chunk(V) < 512 * 256 and kept_tokens(V) == 4096
    assert e.forward - chunked.forward == (3 * (512 * 256 - head_chunk(V)) - 4096) * V * 4
    free = (chunked.total / 0.9 + e.total) / 2   # the chunks fit with the advice's margin
    assert chunked.total / 0.9 < free < e.total
    monkeypatch.setattr(memory, "available", lambda device=None: free)
    assert memory.check(cfg, model, 20) is None
    assert "--logprob-chunk 0" in memory.check(whole, model, 20)
