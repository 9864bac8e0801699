"""Nothing silently corrupted: sampling arguments checked as transformers checks them, a
distribution that keeps a single token scored finitely, and skipped updates counted and
stopped (parity/runs/finite.py). The update paths themselves: tests/test_skipped_updates.py."""

from __future__ import annotations

import math

import pytest
import torch

from parity import metric_names as mn
from parity.config import Config, SamplingArgs, make_config
from parity.errors import ParityError
from parity.logprobs import Sampling, logprobs_from_logits, processed_logits
from parity.runs.finite import LOG_PROB_MAX, LeftOut, LeftOutTally, Skips, usable_tokens


def test_top_p_0_keeps_the_likeliest_token_with_finite_log_probs_and_zero_gradient():
    """transformers' top_p=0 keeps the likeliest token (min_tokens_to_keep=1); so do parity's
    engine and scoring. A distribution of one token has log-prob 0 and no logit moves it, and
    with the sampled token kept beside it (`keep`) it is the two-token softmax, in float64."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from parity.integrations.trl_sampling import token_logps
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    top = logits.argmax(-1)
    s = Sampling(top_p=0.0)
    x = logits.clone().requires_grad_(True)
    lp = logprobs_from_logits(x, top, s)
    lp.sum().backward()
    assert torch.equal(lp, torch.zeros_like(lp)) and torch.equal(x.grad, torch.zeros_like(x))
    engine = processed_logits(logits, s)    # what the engine samples from
    assert (torch.isfinite(engine).sum(-1) == 1).all() and torch.equal(engine.argmax(-1), top)
    theirs = TopPLogitsWarper(0.0)(None, logits.view(-1, 11)).view_as(logits)
    assert torch.equal(torch.isfinite(theirs), torch.isfinite(engine))
    other = (top + 1) % 11
    d = logits.double()
    pick = lambda t: d.gather(-1, t[..., None]).squeeze(-1)
    reference = pick(other) - torch.logaddexp(pick(top), pick(other))
    torch.testing.assert_close(logprobs_from_logits(logits, other, s).double(), reference,
                               rtol=0, atol=1e-6)
    # TRL's scoring under the sampling distribution: ℓ = 0, entropy 0, gradient 0
    ids = torch.cat([torch.zeros(3, 2, dtype=torch.long), top], 1)
    x = logits.clone().requires_grad_(True)
    out, entropy = token_logps(x, ids, torch.ones_like(ids), s, entropy=True)
    (out.sum() + entropy.sum()).backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(entropy, torch.zeros_like(out))
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("field, value, said", [
    ("min_p", 1.5, "GRPOConfig.min_p=1.5 must be <= 1"),
    ("repetition_penalty", 0.0, "GRPOConfig.repetition_penalty=0.0 must be a finite number > 0"),
    ("repetition_penalty", -1.0, "GRPOConfig.repetition_penalty=-1.0 must be"),
    ("temperature", 0.0, "GRPOConfig.temperature=0 is greedy decoding"),
    ("min_p", math.nan, "GRPOConfig.min_p=nan must be a finite number >= 0 and <= 1"),
    ("top_p", math.inf, "GRPOConfig.top_p=inf must be a finite number"),
    ("top_k", -1, "GRPOConfig.top_k=-1 must be >= 0"),
])
def test_sampling_arguments_are_refused_where_transformers_refuses_them(field, value, said):
    with pytest.raises(ParityError) as e:
        SamplingArgs.check("GRPOConfig", **{field: value})
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_what_transformers_samples_from_is_accepted():
    SamplingArgs.check("GRPOConfig", temperature=0.7, top_p=0.0, top_k=0, min_p=None,
                       repetition_penalty=1.3)
    SamplingArgs.check("GRPOConfig", min_p=1.0, top_k=5)


def test_parity_trains_own_flags_hold_the_same_rules():
    assert make_config({"top_p": 0}).top_p == 0.0
    for field, value in (("temperature", 0.0), ("top_p", 1.5), ("top_k", -1),
                         ("temperature", math.nan)):
        with pytest.raises(ParityError, match=f"^{field}="):
            make_config({field: value})
    assert Config().max_consecutive_skips == 20


def test_skips_warn_once_and_stop_after_the_limit_in_a_row():
    said: list[str] = []
    sk = Skips(limit=3)
    sk.skipped(1, "l_pi", said.append)
    sk.skipped(2, "the loss", said.append)
    sk.applied(3)                       # an applied update ends the row
    sk.skipped(4, "the gradient of w", said.append)
    sk.skipped(5, "the gradient of w", said.append)
    with pytest.raises(ParityError, match=r"^step 6: 3 updates in a row skipped for a "
                       r"non-finite gradient \(the gradient of w; max_consecutive_skips=3\): "
                       r"training stops, its weights those of step 3"):
        sk.skipped(6, "the gradient of w", said.append)
    assert said == ["step 1: update skipped, l_pi is not finite; the weights stay as they were, "
                    "and skipped updates are counted in train/skipped_updates"]
    assert sk.total == 5
    never = Skips(limit=0)
    for step in range(100):
        never.skipped(step, "the loss", said.append)


def test_non_finite_tokens_are_masked_and_zeroed():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    a = torch.tensor([[-1.0, math.nan, math.nan], [-2.0, -3.0, -4.0]])
    b = torch.tensor([[-1.0, -1.0, -1.0], [-math.inf, -3.0, -4.0]])
    m, (a2, b2), n = usable_tokens(mask, a, b)
    assert n == LeftOut(non_finite=2)      # the NaN at padding was never a token
    assert m.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    assert torch.isfinite(a2).all() and torch.isfinite(b2).all()


def test_positive_log_probs_are_left_out_counted_and_named_once():
    """A value above 1e-3 is no log-prob: left out, counted apart from NaN and inf, its largest
    named; rounding's hair above 0 stays in; a token both positive and NaN is non-finite."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mu = torch.tensor([[-0.5, 2.0, 9.0, 1e-4, 50.0], [-1.0, math.nan, 3.0, 0.0, -2.0]])
    pi = torch.tensor([[-0.4, -0.1, -0.2, -0.3, 0.0], [-1.1, 4.0, -0.5, 2e-3, -math.inf]])
    m, (mu2, pi2), left = usable_tokens(mask, mu, pi)
    # by hand: [0, 1] and [0, 2] (2.0, 9.0), [1, 2] (3.0), [1, 3] (ℓ_π 2e-3) positive; [1, 1]
    # NaN beside a 4.0 and [1, 4] -inf are non-finite; 50.0 is padding, 1e-4 is rounding's
    assert left == LeftOut(non_finite=2, positive=4, largest=9.0)
    assert m.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]
    assert mu2[0].tolist() == pytest.approx([-0.5, 0.0, 0.0, 1e-4, 0.0])
    assert torch.isfinite(pi2).all()
    said: list[str] = []
    tally = LeftOutTally("verl's batch")
    tally.add(left, said.append)
    tally.add(LeftOut(positive=1, largest=20.0), said.append)    # a later batch: no new line
    assert said == [
        "2 token log-probs from verl's batch are NaN or inf and are left out of every figure "
        "(counted in mismatch/non_finite_tokens)",
        "4 token log-probs from verl's batch are positive, up to 9: these look like logits, not "
        "log-probs (a log-prob is <= 0), and are left out of every figure (counted in "
        "mismatch/positive_tokens)"]
    assert tally.total == LeftOut(non_finite=2, positive=5, largest=20.0)
    assert tally.total.counts() == {mn.NON_FINITE_TOKENS: 2, mn.POSITIVE_TOKENS: 5}
    # the metric's documented threshold is the rule's
    row = next(r for r in mn.ROWS if any(m.name == mn.POSITIVE_TOKENS for m in r.metrics))
    assert LOG_PROB_MAX == 1e-3 and "above 1e-3" in row.meaning


def test_left_out_tokens_of_every_rank_gather_to_one_count():
    ranks = [LeftOut(1, 2, 3.5), LeftOut(), LeftOut(0, 4, 9.0)]
    gathered = torch.cat([r.as_tensor("cpu") for r in ranks])
    assert LeftOut.gathered(gathered) == LeftOut(1, 6, 9.0) == sum(ranks, LeftOut())
