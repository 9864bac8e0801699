"""Every recipe and objective end to end, and what each fix promises."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parity.config import RECIPES, make_config
from parity.logprobs import Rollout, Sampling
from parity.models.forward import score
from parity.objectives import OBJECTIVES, log_ratio
from parity.trainer import train

# The whole product: on the test-size arith model 20 steps take well under a second each.
PAIRS = [(r, o) for r in RECIPES for o in OBJECTIVES]


def run(tmp_path, name="run", on_model=None, **kw):
    cfg = make_config({"out": str(tmp_path / name), "progress": False, **kw})
    out = train(cfg, on_model)
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def finite(rows):
    """Every number finite; null only for the gradient norm of a skipped update."""
    for r in rows:
        for k, v in r.items():
            if v is None:
                assert k == "train/grad_norm" and r["train/skipped_this_step"] > 0, (k, r)
            elif isinstance(v, float) and not math.isfinite(v):
                return False
    return True


@pytest.mark.e2e
@pytest.mark.parametrize("recipe,objective", PAIRS)
def test_recipe_objective_pair_runs_20_arith_steps(tmp_path, arith_model, recipe, objective):
    out, rows = run(tmp_path, task="arith", model="arith-xs", recipe=recipe, objective=objective,
                    steps=20, prompts_per_step=4, samples_per_prompt=4, lr=3e-4)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert finite(rows)
    # An overflowing fp16 step is skipped and halves the loss scale (the scale grows only after
    # 400 clean updates, not within 20); most updates apply. How many overflow depends on the
    # CPU's kernels: 3 of 20 on one without AMX, at most 2 on one with it.
    assert rows[-1]["train/skipped_updates"] <= 5
    if RECIPES[recipe].settings["trainer_dtype"] == "fp16":
        init = make_config({}).loss_scale_init
        assert [r["loss/scale"] for r in rows] == [init / 2 ** r["train/skipped_updates"]
                                                   for r in rows]
    m = rows[0]
    if objective == "online-dpo":
        assert "dpo/pairs" in m
    if objective == "ppo-value":
        assert "loss/value" in m and (out / "checkpoints" / "step-20" /
                                      "value_head.safetensors").is_file()
    if RECIPES[recipe].settings.get("correction", "none") != "none":
        assert {"is/weight_mean_raw", "is/weight_mean", "is/frac_changed"} <= set(m)


@pytest.mark.e2e
def test_shadow_ratio_gradient_is_r_times_grad_logp(tiny_lm):
    """The shadow ratio (docs/design.md) r = exp(ℓ_π − sg(ℓ_π) + ℓ_s − ℓ_μ): ∇r = r·∇ℓ_π, on a
    real model."""
    g = torch.Generator().manual_seed(0)
    r = Rollout(torch.randint(2, 16, (3, 4), generator=g), torch.ones(3, 4, dtype=torch.long),
                torch.randint(2, 16, (3, 5), generator=g), torch.ones(3, 5),
                -torch.rand(3, 5, generator=g) * 3, torch.zeros(3, dtype=torch.bool))
    r.completion_mask[1, 3:] = 0
    logp_s = -torch.rand(3, 5, generator=g) * 3
    adv = torch.tensor([1.0, -0.5, 2.0])
    params = [p for p in tiny_lm.parameters()]

    logp_pi = score(tiny_lm, r, Sampling())
    ratio = log_ratio("shadow", logp_pi, r.engine_logprobs, logp_s).exp()
    (-(ratio * adv[:, None] * r.completion_mask).sum()).backward()
    got = [p.grad.clone() for p in params]
    value = (logp_s - r.engine_logprobs).exp()
    assert torch.allclose(ratio.detach(), value)           # the value has no β in it
    tiny_lm.zero_grad()
    logp_pi = score(tiny_lm, r, Sampling())
    (-(value * adv[:, None] * logp_pi * r.completion_mask).sum()).backward()  # r · ∇ℓ_π
    for a, b in zip(got, [p.grad for p in params]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(a.abs().max() > 0 for a in got)


@pytest.mark.e2e
def test_bf16_shadow_has_no_phantom_clipping_but_logs_alpha_clipping(tmp_path, text_model):
    """With the shadow ratio the clip sees α only: phantom = 0 by construction. A tight ε and a
    large learning rate make the policy itself move past the bound, which is still logged."""
    _, rows = run(tmp_path, model="text-xs", recipe="bf16-shadow", steps=4, lr=3e-3,
                  prompts_per_step=4, samples_per_prompt=4, minibatches=2, epochs=2,
                  eps_low=0.01, eps_high=0.01)
    assert all(r["clip/phantom_frac"] == 0.0 and r["clip/hidden_frac"] == 0.0 for r in rows)
    assert all(r["clip/frac"] == r["clip/alpha_frac"] for r in rows)
    assert max(r["clip/alpha_frac"] for r in rows) > 0.01
    _, engine_rows = run(tmp_path, "engine", model="text-xs", recipe="bf16-engine", steps=4,
                         lr=3e-3, prompts_per_step=4, samples_per_prompt=4, minibatches=2,
                         epochs=2, eps_low=0.01, eps_high=0.01)
    assert max(r["clip/phantom_frac"] for r in engine_rows) > 0  # the same setting with β in


@pytest.mark.e2e
def test_fp16_overflow_is_skipped_and_the_run_recovers(tmp_path, text_model):
    """Inject an overflow into the trainer's fp16 forward on two steps: those updates are
    skipped (never applied), the loss scale drops, the weights stay finite, training goes on."""
    calls = {"n": 0}

    def inject(model):
        def blow_up(module, args, output):
            if torch.is_grad_enabled():  # the trainer's forward, not the engine's or shadow's
                calls["n"] += 1
                if calls["n"] in (3, 4):
                    return output * 1e6  # the logits beyond fp16's 65504: inf loss
            return output
        # the final norm runs once per forward; the head once per chunk, and again in the
        # backward
        model.get_decoder().norm.register_forward_hook(blow_up)

    out, rows = run(tmp_path, model="text-xs", recipe="fp16", steps=6, lr=1e-3,
                    prompts_per_step=2, samples_per_prompt=4, max_new_tokens=8,
                    on_model=inject)
    skipped = [r["train/skipped_this_step"] for r in rows]
    assert skipped == [0, 0, 1, 1, 0, 0]
    assert rows[-1]["train/skipped_updates"] == 2
    assert rows[3]["loss/scale"] < rows[1]["loss/scale"]
    from safetensors.torch import load_file
    weights = load_file(str(out / "checkpoints" / "step-6" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert math.isfinite(rows[-1]["reward/mean"]) and rows[-1]["sync/changed_frac"] > 0
    # What a skipped step measured from its overflowed forward (β, the KL, the loss) is written
    # as missing, never as inf or nan; the other steps miss nothing.
    for r in rows:
        missing = {k for k, v in r.items() if v is None}
        assert all(math.isfinite(v) for v in r.values() if v is not None), r["step"]
        assert "mismatch/beta_abs_mean" in missing if r["train/skipped_this_step"] else not missing


@pytest.mark.e2e
def test_recompute_logs_weights_before_and_after(tmp_path, text_model):
    _, rows = run(tmp_path, model="text-xs", recipe="tis", steps=2, prompts_per_step=2,
                  samples_per_prompt=4, max_new_tokens=8, is_cap=1.001)
    m = rows[0]
    # ℓ_old is the trainer's own forward: the weights are exp(β) ≈ 1, some of them above 1.001.
    assert 0 < m["is/frac_changed"] < 1
    assert m["is/weight_max_raw"] > 1.001
    assert m["is/weight_mean"] < m["is/weight_mean_raw"]  # truncation only ever lowers weights
    assert m["clip/frac"] == 0.0  # at the first update ℓ_π = ℓ_old: nothing to clip


@pytest.mark.e2e
def test_online_dpo_margin_carries_beta_with_an_engine_reference(tmp_path, text_model):
    _, rows = run(tmp_path, model="text-xs", objective="online-dpo", dpo_ref="engine", steps=2,
                  prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8)
    m = rows[0]
    assert m["dpo/pairs"] > 0 and m["dpo/margin_beta_abs"] > 0  # bf16 engine: β ≠ 0
    _, rows = run(tmp_path, "fp32", model="text-xs", recipe="fp32", objective="online-dpo",
                  dpo_ref="engine", steps=1, prompts_per_step=4, samples_per_prompt=4,
                  max_new_tokens=8)
    assert rows[0]["dpo/margin_beta_abs"] == 0.0  # fp32 both sides: ℓ_s = ℓ_π, no gap


@pytest.mark.e2e
def test_fp32_lm_head_shrinks_the_gap(tmp_path, text_model):
    _, plain = run(tmp_path, "plain", model="text-xs", steps=1, prompts_per_step=8,
                   samples_per_prompt=8, lr=1e-6)
    _, head = run(tmp_path, "head", model="text-xs", steps=1, prompts_per_step=8,
                  samples_per_prompt=8, lr=1e-6, lm_head_fp32=True)
    assert head[0]["mismatch/beta_abs_mean"] < plain[0]["mismatch/beta_abs_mean"]


@pytest.mark.parametrize("args,words", [
    (["--correction", "token-tis"], "needs ratio_source=recompute"),
    (["--eps-low", "-0.2"], "eps_low=-0.2 must be a finite number >= 0"),
    (["--objective", "gspo", "--eps-high", "0.28"], "seq_eps_low/seq_eps_high"),
    (["--recipe", "tis", "--is-cap", "0.5"], "is_cap=0.5"),
])
def test_invalid_combination_is_refused_before_any_work(tmp_path, capsys, args, words):
    """One line, exit 2, no run directory, no model built (the default model is not in the
    test cache, so any work would show as a build)."""
    from parity.cli import main
    code = main(["train", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.startswith("parity: error:")
    assert not (tmp_path / "run").exists()
