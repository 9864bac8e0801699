"""The objective table: each objective's facts in one place, and its loss on a minibatch
checked against hand-computed references (float64, written out here, not the library's
helpers)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parity.config import make_config
from parity.errors import ParityError
from parity.objectives import OBJECTIVES, Minibatch, clipped_tokens


def cfg(**kw):
    base = dict(eps_low=0.2, eps_high=0.2, seq_eps_low=3e-4, seq_eps_high=4e-4,
                loss_agg="seq-mean", max_new_tokens=3, value_clip=0.2, value_coef=0.5,
                is_cap=2.0, samples_per_prompt=2, dpo_scale=0.1, dpo_ref="initial")
    return SimpleNamespace(**{**base, **kw})


def batch() -> Minibatch:
    # two prompts x two completions, lengths 3, 2, 1, 3
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    log_r = torch.tensor([[0.3, -0.1, 0.0], [0.05, -0.4, 9.0], [0.01, 0, 0], [-0.3, 0.1, 0.2]])
    logp_pi = torch.tensor([[-1.0, -0.5, -2.0], [-0.7, -0.2, 0.0], [-3.0, 0, 0],
                            [-0.1, -0.9, -1.2]], requires_grad=True)
    return Minibatch(log_r=log_r, logp_pi=logp_pi, logp_s=logp_pi.detach() - 0.01,
                     mask=mask, adv=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                     rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]),
                     values=torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.0], [0.9, 0, 0],
                                          [0.4, 0.4, 0.4]]),
                     old_values=torch.zeros(4, 3), returns=torch.ones(4, 3) * mask,
                     ref=logp_pi.detach() + 0.05)


class Shares:
    """Records what each loss says it is a mean over; the identity otherwise (one process)."""
    def __init__(self):
        self.units: list[float] = []
        self.kinds: list[str] = []

    def __call__(self, loss, n, unit):
        self.units.append(n)
        self.kinds.append(unit)
        return loss


def test_every_objective_name_in_the_config_has_one_table_entry():
    for name in OBJECTIVES:
        assert make_config({"objective": name}).objective == name
    with pytest.raises(ParityError, match="objective"):
        make_config({"objective": "ppo-clipp"})


def test_clip_ranges_come_from_the_objectives_own_fields():
    c = cfg(eps_low=0.1, eps_high=0.3)
    assert OBJECTIVES["ppo-clip"].clip_range(c) == (0.1, 0.3)
    assert OBJECTIVES["ppo-value"].clip_range(c) == (0.1, 0.3)
    assert OBJECTIVES["gspo"].clip_range(c) == (3e-4, 4e-4)
    assert OBJECTIVES["pg-is"].clip_range(c) == (None, None)
    assert OBJECTIVES["online-dpo"].clip_range(c) == (None, None)
    assert [o.name for o in OBJECTIVES.values() if o.value_head] == ["ppo-value"]
    assert [o.name for o in OBJECTIVES.values() if o.reference] == ["online-dpo"]


def _ppo_seq_mean_reference(b: Minibatch, eps: float) -> float:
    total = 0.0
    for i in range(4):
        n = int(b.mask[i].sum())
        row = 0.0
        for t in range(n):
            r, a = math.exp(float(b.log_r[i, t])), float(b.adv[i])
            row += -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
        total += row / n
    return total / 4


def test_ppo_clip_loss_and_its_units_against_a_hand_computation():
    b, share = batch(), Shares()
    out = OBJECTIVES["ppo-clip"].loss(cfg(), b, share)
    assert out.policy == pytest.approx(_ppo_seq_mean_reference(b, 0.2), rel=1e-6)
    assert float(out.total) == out.policy
    assert share.units == [4.0] and share.kinds == ["sequences"]  # seq-mean: over sequences
    # row 0 token 0: r = e^0.3 = 1.35 > 1.2 with A > 0; row 1 token 1: r = e^-0.4 = 0.67 < 0.8
    # with A < 0; row 3 token 0: r = e^-0.3 = 0.74 < 0.8 with A < 0. Row 1's padding holds
    # log r = 9 and is never clipped.
    assert out.clipped.nonzero().tolist() == [[0, 0], [1, 1], [3, 0]]
    share = Shares()
    OBJECTIVES["ppo-clip"].loss(cfg(loss_agg="token-mean"), b, share)
    assert share.units == [9.0] and share.kinds == ["tokens"]  # token-mean: valid tokens


def test_ppo_value_reports_the_policy_loss_apart_from_the_value_loss():
    b, share = batch(), Shares()
    out = OBJECTIVES["ppo-value"].loss(cfg(), b, share)
    policy = _ppo_seq_mean_reference(b, 0.2)
    v, old, ret, m = b.values.double(), b.old_values.double(), b.returns.double(), b.mask
    clipped_v = old + (v - old).clamp(-0.2, 0.2)
    per_tok = 0.5 * torch.maximum((v - ret) ** 2, (clipped_v - ret) ** 2)
    value = float((per_tok * m).sum() / m.sum())
    assert out.policy == pytest.approx(policy, rel=1e-6)
    assert out.metrics["loss/value"] == pytest.approx(value, rel=1e-6)
    assert float(out.total) == pytest.approx(policy + 0.5 * value, rel=1e-6)
    # the policy over sequences, the value over tokens
    assert share.units == [4.0, 9.0] and share.kinds == ["sequences", "tokens"]


def test_gspo_clips_whole_sequences_on_their_mean_log_ratio():
    b = batch()
    out = OBJECTIVES["gspo"].loss(cfg(seq_eps_low=0.05, seq_eps_high=0.05), b, Shares())
    # mean log r per row: 0.0667 (A>0: > log 1.05 = 0.0488, clipped), -0.175 (A<0: < log .95,
    # clipped), 0.01 (A>0, not), 0.0 (not)
    assert out.clipped.tolist() == [[True] * 3, [True, True, False], [False] * 3, [False] * 3]
    same = clipped_tokens(b.log_r, b.adv, b.mask, 0.05, 0.05, sequence=True)
    assert torch.equal(same, out.clipped)


def test_online_dpo_is_a_mean_over_pairs():
    b, share = batch(), Shares()
    out = OBJECTIVES["online-dpo"].loss(cfg(), b, share)
    # group 0: rewards 1 > 0 -> one pair (0 chosen, 1 rejected); group 1: equal -> none
    assert share.units == [1.0] and share.kinds == ["pairs"] and out.metrics["dpo/pairs"] == 1.0
    seq = ((b.logp_pi.detach() - b.ref) * b.mask).sum(-1).double()
    m = 0.1 * (seq[0] - seq[1])
    assert out.policy == pytest.approx(float(-torch.log(torch.sigmoid(m))), rel=1e-6)
    assert not out.clipped.any()
