"""Objectives against hand-computed cases."""

import math

import pytest
import torch

from parity.objectives import clip_predicate, grpo_advantages, ppo_clip_loss


def test_grpo_advantages_hand_computed():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 2: all equal -> 0 advantage (no signal, no division blow-up)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    a = grpo_advantages(r, 4, scale=True, eps=0.0 + 1e-4)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4)] * 2
    assert a[:4].tolist() == pytest.approx([expected[0], expected[1], expected[1], expected[0]],
                                           rel=1e-6)
    assert a[4:].tolist() == [0.0] * 4
    assert grpo_advantages(r, 4, scale=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_ppo_clip_gradient_hand_computed():
    # Two sequences, eps_low = 0.2, eps_high = 0.3.
    # seq 0 (A = +2): tokens r = e^0.1 (inside), e^0.4 (> 1.3: clipped), third token padding.
    # seq 1 (A = -1): tokens r = e^-0.1 (inside), e^-0.3 (< 0.8: clipped), e^0.5 (A<0, r>1: not
    # clipped -- PPO only stops ratios moving *further* in the advantage's direction).
    logp_old = torch.zeros(2, 3)
    x = torch.tensor([[0.1, 0.4, 0.0], [-0.1, -0.3, 0.5]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, clipped = ppo_clip_loss(x - logp_old, adv, mask, eps_low=0.2, eps_high=0.3)
    loss.backward()
    # loss = mean over sequences of token means of -min(rA, clip(r)A); d/dx of -rA is -A r.
    e = math.exp
    expected_loss = 0.5 * ((-2 * e(0.1) - 2 * 1.3) / 2 + (e(-0.1) + 0.8 + e(0.5)) / 3)
    expected_grad = [[-2 * e(0.1) / 2 / 2, 0.0, 0.0],
                     [e(-0.1) / 3 / 2, 0.0, e(0.5) / 3 / 2]]
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-6)
    assert x.grad.tolist()[0] == pytest.approx(expected_grad[0], rel=1e-6)
    assert x.grad.tolist()[1] == pytest.approx(expected_grad[1], rel=1e-6)
    assert clipped.tolist() == [[False, True, False], [False, True, False]]


@pytest.mark.parametrize("x,adv,expected", [
    (0.30, 1.0, True), (0.20, 1.0, False), (-0.30, 1.0, False),   # A > 0: only the upper side
    (-0.30, -1.0, True), (-0.10, -1.0, False), (0.30, -1.0, False),  # A < 0: only the lower side
    (5.0, 0.0, False), (-5.0, 0.0, False),                         # A = 0: never clipped
])
def test_clip_predicate_truth_table(x, adv, expected):
    # asymmetric range: log(1 + 0.28) = 0.247, log(1 - 0.2) = -0.223
    got = clip_predicate(torch.tensor([x]), torch.tensor([adv]), eps_low=0.2, eps_high=0.28)
    assert bool(got[0]) is expected


def test_no_clip_when_eps_is_none():
    got = clip_predicate(torch.tensor([9.0, -9.0]), torch.tensor([1.0, -1.0]), None, None)
    assert not got.any()
