"""ParityGRPOTrainer on the test-size mixture of experts: the routing parity's engine recorded
rides TRL's batch (parity/integrations/trl_routing.py) and the trainer's own routing is
compared with it at the loss's forward, logged under `routing/` beside TRL's own figures."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration test needs trl (pip install '.[test]')")

from parity import metric_names as mn  # noqa: E402
from parity.integrations.trl import ParityOptions  # noqa: E402
from parity.integrations.trl_routing import place  # noqa: E402
from test_trl import _steps, _trainer  # noqa: E402

pytestmark = pytest.mark.e2e


def test_trl_logs_the_routing_figures_and_fp32_on_both_sides_routes_alike(moe_model, tmp_path):
    """bf16 engine: the routing figures in TRL's log at every step, the layers' shares
    averaging to the overall one. fp32 engine and trainer: the same experts at nearly every
    decision, which only holds if TRL's batch carries each row's record in its own columns
    (a record one column off or on another row disagrees at most decisions)."""
    for recipe, opts in (("bf16", ParityOptions.from_recipe("bf16-engine")),
                         ("fp32", ParityOptions.from_recipe("bf16-engine", engine_dtype="fp32"))):
        t = _trainer(moe_model, tmp_path / recipe, steps=2, parity=opts)
        t.train()
        steps = _steps(t)
        assert len(steps) == 2
        for h in steps:
            layers = [h[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j)] for j in (0, 1)]
            assert 0 <= h[mn.ROUTING_FLIP_FRAC] <= 1 and math.isfinite(h[mn.ROUTING_MARGIN_MEAN])
            assert h[mn.ROUTING_FLIP_FRAC] == pytest.approx(sum(layers) / 2, rel=1e-6)
            assert 0 <= h[mn.ROUTING_TOKEN_FLIP_FRAC] <= 1
            if recipe == "fp32":
                assert h[mn.ROUTING_FLIP_FRAC] < 0.01, h[mn.ROUTING_FLIP_FRAC]


def test_the_record_is_placed_in_trls_columns():
    """Prompts left-padded to 2 in the record and to 4 (a multiple) in TRL's batch,
    completions of 3 cut to TRL's 2: each known column lands where TRL has its token."""
    routed = torch.arange(2 * 5 * 1 * 2, dtype=torch.uint8).view(2, 5, 1, 2)
    prompt, completion = torch.zeros(2, 4), torch.zeros(2, 2)
    out = place(routed, 2, prompt, completion)
    assert out.shape == (2, 6, 1, 2) and out.dtype == torch.uint8
    assert (out[:, :2] == 255).all()                     # TRL's extra padding: unknown
    assert torch.equal(out[:, 2:4], routed[:, 0:2])      # the prompt, right-aligned
    assert torch.equal(out[:, 4:6], routed[:, 2:4])      # the completion, cut to TRL's width
    wide = place(routed, 2, torch.zeros(2, 2), torch.zeros(2, 5))
    assert torch.equal(wide[:, :5], routed) and (wide[:, 5:] == 255).all()
    assert place(routed, 2, torch.zeros(3, 2), completion) is None   # not TRL's rows
