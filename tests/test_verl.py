"""parity inside verl (parity/integrations/verl.py), against verl 0.9.1 itself: its plugin loading,
its config, its rollout correction and its metrics, with a real rollout of SmolLM2 sampled by
vLLM's CPU build. verl's trainer needs GPUs and Ray workers; what runs here is the driver-side
code the plugin wraps (docs/verl.md)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from parity.config import RECIPES
from parity.integrations.verl import (
    VERL_NAMES,
    RunSettings,
    install,
    recipe_overrides,
    settings_of,
    step_figures,
)
from parity.objectives import behaviour_weights

# verl's own code runs in these tests, and importing it takes seconds: the whole module is in the
# end-to-end tier (tests/conftest.py does not even import it for the fast one).
pytestmark = pytest.mark.e2e

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(
    not HAVE_VERL and not os.environ.get("PARITY_REQUIRE_VERL"),
    reason="verl not installed: pip install 'parity[verl]' (.ci/run installs it for CI)")


def test_a_verl_version_it_was_not_written_for_gets_nothing_and_one_line(capsys):
    before = list(sys.meta_path)
    assert install("0.0.1") is False
    assert sys.meta_path == before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "verl 0.0.1" in err and "0.9.1" in err


def _batch(seed: int = 0, rows: int = 6, t: int = 12):
    """A verl batch as the driver holds it after compute_advantage, with a bf16-sized gap."""
    from verl import DataProto
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, t + 1, (rows,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, t, generator=g) * 3 * mask
    # a log-prob is <= 0: the plugin leaves a positive one out (parity/runs/finite.py)
    mu = (old + 0.3 * torch.randn(rows, t, generator=g)).clamp(max=0.0) * mask
    adv = torch.randn(rows, 1, generator=g).expand(rows, t) * mask
    prompts = torch.randint(5, 50, (rows, 4), generator=g)
    responses = torch.randint(5, 50, (rows, t), generator=g)
    return DataProto.from_dict(tensors={
        "old_log_probs": old, "rollout_log_probs": mu, "response_mask": mask,
        "advantages": adv, "returns": adv.clone(), "token_level_scores": adv.clone(),
        "token_level_rewards": adv.clone(), "prompts": prompts, "responses": responses,
        "attention_mask": torch.cat([torch.ones(rows, 4), mask], 1).long(),
        "input_ids": torch.cat([prompts, responses], 1)})


@needs_verl
@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipes_verl_settings_compose_with_verls_own_config(name):
    """`parity recipes --for verl NAME` is a list of Hydra overrides verl's ppo_trainer.yaml
    accepts, and verl's typed configs read them back as the recipe means them."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils.config import omega_conf_to_dataclass
    st = RECIPES[name].settings
    overrides, _ = recipe_overrides(st)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        # a micro-batch size, which every verl run sets and the actor's config requires
        cfg = compose(config_name="ppo_trainer", overrides=overrides + [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    correction = omega_conf_to_dataclass(cfg.algorithm.rollout_correction,
                                         RolloutCorrectionConfig)
    assert actor.fsdp_config.mixed_precision["param_dtype"] == st["trainer_dtype"]
    assert cfg.actor_rollout_ref.rollout.dtype == {"bf16": "bfloat16", "fp16": "float16",
                                                   "fp32": "float32"}[st["engine_dtype"]]
    assert correction.bypass_mode == (st["ratio_source"] == "engine")
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    if st["eps_high"] is not None:
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == (st["eps_low"], st["eps_high"])
    assert (correction.rollout_is is None) == (
        st["correction"] in ("none", "geo-rs"))
    # what the plugin reads from the run's config when its trainer starts
    assert settings_of(cfg) == RunSettings(
        eps_low=1.0 if st["eps_low"] is None else st["eps_low"],
        eps_high=1e9 if st["eps_high"] is None else st["eps_high"], clip="token",
        bypass=st["ratio_source"] == "engine", verl_corrects=st["correction"] != "none")


def _verl_setting(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].endswith(key))


@needs_verl
@pytest.mark.parametrize("correction", ["token-tis", "token-mis", "token-icepop", "seq-tis"])
def test_parity_corrections_weigh_as_verls_settings_for_them(correction):
    """parity's weights (objectives/losses.py) against verl's compute_rollout_correction_weights
    at the settings `parity recipes --for verl` prints for the correction: IcePop and the rest
    are the same weights in both."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    st = {**RECIPES["icepop"].settings, "correction": correction, "is_cap": 1.2,
          "is_cap_low": 0.8}   # caps the gap below reaches on both sides
    overrides, _ = recipe_overrides(st)
    b = _batch(seed=1).batch
    old, mu, mask = b["old_log_probs"], b["rollout_log_probs"], b["response_mask"]
    ours, stats = behaviour_weights(old.double(), mu.double(), mask, correction, st["is_cap"],
                                    1.01, st["is_cap_low"])
    theirs, _ = compute_rollout_correction_weights(
        old - mu, mask, rollout_is=_verl_setting(overrides, "rollout_is"),
        rollout_is_threshold=_verl_setting(overrides, "rollout_is_threshold"))
    assert 0 < stats["is/frac_changed"] < 1      # the cap and, for IcePop, the floor bite
    torch.testing.assert_close(ours.float(), theirs.float() * mask, rtol=1e-6, atol=1e-6)


@needs_verl
def test_the_figures_are_parity_measure_on_verls_batch():
    """With the engine's own ℓ_μ as the shadow, β is ℓ_old − ℓ_μ: the figures are the audit's
    whole-gap ones, and the α ones are left out rather than logged as the 0 they are here."""
    batch = _batch()
    b = batch.batch
    f = step_figures(batch, RunSettings(eps_low=0.2, eps_high=0.28))
    gap = (b["old_log_probs"] - b["rollout_log_probs"]).double()[b["response_mask"] > 0]
    assert f["parity/mismatch/beta_abs_mean"] == pytest.approx(float(gap.abs().mean()), rel=1e-12)
    assert f["parity/mismatch/kl_k1"] == pytest.approx(float(-gap.mean()), rel=1e-12)
    assert f["parity/clip/phantom_frac"] == f["parity/clip/frac"] > 0
    assert not {"parity/mismatch/alpha_abs_mean", "parity/clip/hidden_frac",
                "parity/mismatch/kernel_gap_abs_mean"} & set(f)
    # verl's own names for the same KLs, where verl's rollout correction does not log them
    assert (f["rollout_corr/kl"], f["rollout_corr/k3_kl"]) == (f["parity/mismatch/kl_k1"],
                                                              f["parity/mismatch/kl_k3"])
    assert not {"rollout_corr/kl", "rollout_corr/k3_kl"} & set(
        step_figures(batch, RunSettings(verl_corrects=True)))
    assert step_figures(batch, RunSettings(bypass=True)) == {}
    unclipped = step_figures(batch, RunSettings(clip=None))
    assert "parity/clip/frac" not in unclipped and "parity/mismatch/beta_abs_mean" in unclipped


@needs_verl
def test_a_non_finite_log_prob_is_left_out_of_every_figure_and_counted_once(caplog):
    """One NaN in ℓ_μ and one -inf in ℓ_old: the figures are those of the batch without those
    two tokens (the same batch with them masked out), the count is 2, and one warning says so
    over two steps."""
    batch, without = _batch(), _batch()
    for b in (batch, without):
        b.batch["response_mask"][0, 0] = b.batch["response_mask"][2, 1] = 1.0
    batch.batch["rollout_log_probs"][0, 0] = float("nan")
    batch.batch["old_log_probs"][2, 1] = float("-inf")
    without.batch["response_mask"][0, 0] = without.batch["response_mask"][2, 1] = 0.0
    run = RunSettings()
    with caplog.at_level(logging.WARNING, logger="parity.integrations.verl"):
        f = step_figures(batch, run)
        step_figures(batch, run)
    expected = step_figures(without, RunSettings())
    assert f.pop("parity/mismatch/non_finite_tokens") == 2.0
    assert f == pytest.approx(expected, rel=1e-12)
    assert all(math.isfinite(v) for v in f.values())
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("parity: 2 token log-probs")


@needs_verl
def test_a_row_of_positive_log_probs_is_left_out_counted_and_named_once(caplog):
    """rollout_log_probs holding logits by mistake: one row of 2.0 to 9.0. The token figures are
    those of the batch without that row (sliced off); the row's tokens are counted, and one
    warning over two steps names them as logits."""
    batch, masked = _batch(), _batch()
    n = int(batch.batch["response_mask"][0].sum())
    batch.batch["rollout_log_probs"][0, :n] = torch.linspace(2.0, 9.0, n)
    masked.batch["response_mask"][0] = 0.0
    run = RunSettings()
    with caplog.at_level(logging.WARNING, logger="parity.integrations.verl"):
        f = step_figures(batch, run)
        step_figures(batch, run)
    assert f.pop("parity/mismatch/positive_tokens") == float(n)
    assert "parity/mismatch/non_finite_tokens" not in f
    # The sequence log-ratio is a figure per completion: the emptied row is still one, of no
    # token, as in the batch with that row masked out.
    per_completion = {"parity/mismatch/seq_log_ratio_mean", "parity/mismatch/seq_log_ratio_slope"}
    sliced = step_figures(batch[1:], RunSettings())
    assert {k: v for k, v in f.items() if k not in per_completion} == pytest.approx(
        {k: v for k, v in sliced.items() if k not in per_completion}, rel=1e-12)
    assert f == pytest.approx(step_figures(masked, RunSettings()), rel=1e-12)
    assert [r.getMessage() for r in caplog.records] == [
        f"parity: {n} token log-probs from verl's batch are positive, up to 9: these look like "
        "logits, not log-probs (a log-prob is <= 0), and are left out of every figure (counted "
        "in mismatch/positive_tokens)"]


@needs_verl
def test_a_batch_without_rollout_log_probs_says_once_which_setting_gives_them(caplog):
    batch = _batch()
    batch.pop(batch_keys=["rollout_log_probs"])
    run = RunSettings()
    with caplog.at_level(logging.WARNING, logger="parity.integrations.verl"):
        assert step_figures(batch, run) == {} and step_figures(batch, run) == {}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert "actor_rollout_ref.rollout.calculate_log_probs=True" in warned[0]


@needs_verl
def test_a_mixture_of_experts_batch_gets_the_dense_figures_and_one_line_why_no_routing(caplog):
    dense = step_figures(_batch(), RunSettings())
    batch, run = _batch(), RunSettings()
    rows, t = batch.batch["response_mask"].shape
    # as verl holds it: [batch, prompt + response, layers, top_k]
    batch.batch["routed_experts"] = torch.randint(0, 8, (rows, 4 + t, 2, 2), dtype=torch.int16)
    with caplog.at_level(logging.WARNING, logger="parity.integrations.verl"):
        assert step_figures(batch, run) == dense and step_figures(batch, run) == dense
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "one side's routing" in warned[0], warned
    assert "no routing/ figures" in warned[0] and "docs/moe.md" in warned[0]
    assert not any(k.startswith("parity/routing/") for k in dense) and dense


_VERL_FUNCTIONS = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_verl import _batch
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import metric_utils
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils.debug.metrics import calculate_debug_metrics
import verl.trainer.ppo.ray_trainer as ray_trainer
batch = _batch(seed=2)
before = {k: v.clone() for k, v in batch.batch.items()}
out = {"debug": calculate_debug_metrics(batch),
       "data": metric_utils.compute_data_metrics(batch, use_critic=False),
       "trainer_data": ray_trainer.compute_data_metrics(batch, use_critic=False),
       "plugin": "parity.integrations.verl_plugin" in sys.modules}
out["batch_untouched"] = (set(before) == set(batch.batch.keys())
                          and all(torch.equal(before[k], batch.batch[k]) for k in before))
corrected, m = compute_rollout_correction_and_add_to_batch(
    batch, RolloutCorrectionConfig.decoupled_token_icepop())
out["correction"] = m
out["weights"] = corrected.batch["rollout_is_weights"].tolist()
print(json.dumps(out, default=float))
"""


def _in_verl(plugins: str) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins}
    p = subprocess.run([sys.executable, "-c", _VERL_FUNCTIONS, os.path.dirname(__file__)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_verl
@pytest.mark.e2e
def test_import_verl_loads_the_plugin_and_verls_own_results_stay_the_same():
    """`import verl` loads parity through the entry point (and not when verl's plugins are off);
    verl's own rollout correction, debug metrics and data metrics come out the same with the
    plugin loaded as without it, and its trainer's metrics gain parity's figures only."""
    without, with_ = _in_verl("none"), _in_verl("auto")
    assert not without["plugin"] and with_["plugin"]
    assert with_["batch_untouched"] and without["batch_untouched"]   # bit for bit
    for key in ("debug", "data", "correction", "weights"):
        assert with_[key] == without[key], key
    assert without["trainer_data"] == without["data"]
    added = {k: v for k, v in with_["trainer_data"].items() if k not in with_["data"]}
    assert {k: with_["trainer_data"][k] for k in with_["data"]} == with_["data"]
    assert added and all(k.startswith("parity/") or k in VERL_NAMES.values() for k in added)
    # verl's own k3 estimate of the same batch, computed by its rollout correction
    assert added["parity/mismatch/kl_k3"] == added["rollout_corr/k3_kl"] == pytest.approx(
        with_["correction"]["rollout_corr/k3_kl"], rel=1e-5)


# parity's figure in the plugin, and the audit's name for the same quantity: with ℓ_s = ℓ_μ the
# plugin's β is the audit's whole engine-trainer gap.
SAME_AS_THE_AUDIT = {"clip/frac": "clip/frac",
                     "mismatch/beta_abs_mean": "mismatch/log_ratio_abs_mean",
                     "mismatch/beta_abs_max": "mismatch/log_ratio_abs_max",
                     **{k: k for k in ("mismatch/kl_k1", "mismatch/kl_k3",
                                       "mismatch/prob_diff_abs_mean", "mismatch/prob_diff_max",
                                       "mismatch/prob_diff_min", "mismatch/seq_log_ratio_mean",
                                       "mismatch/seq_log_ratio_slope")}}


def _rollout_file(path, model, tok, model_dir) -> None:
    """16 completions of SmolLM2 sampled by vLLM's CPU build in bf16, 4 per prompt, with GRPO
    advantages: another system's rollout, as `parity audit --rollouts` reads one."""
    from parity.logprobs import Sampling
    from parity.tasks.data import text_prompts
    from vllm_helpers import vllm_engine
    prompts = [tok(p)["input_ids"] for p in text_prompts(4)]
    engine = vllm_engine(model, tok, model_dir)
    try:
        r = next(engine).generate([p for p in prompts for _ in range(4)], 24, Sampling(),
                                  torch.Generator().manual_seed(0))
    finally:
        engine.close()
    lengths = r.completion_mask.sum(-1).long()
    # any reward that varies within a group: SmolLM2 fills all 24 tokens, so length would not
    reward = ((r.completion_ids % 2 == 0) * r.completion_mask).sum(-1).double().view(4, 4)
    adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)
    with open(path, "w") as f:
        for i, n in enumerate(lengths.tolist()):
            f.write(json.dumps({"prompt_token_ids": prompts[i // 4],
                                "completion_token_ids": r.completion_ids[i, :n].tolist(),
                                "engine_logprobs": r.engine_logprobs[i, :n].tolist(),
                                "advantage": float(adv[i])}) + "\n")


def _verl_batch_from_audit(tokens_parquet):
    """The audit's tokens as the verl driver's batch: ℓ_old the fp32 trainer's log-probs."""
    import pyarrow.parquet as pq
    from verl import DataProto
    t = pq.read_table(tokens_parquet).to_pydict()
    rows, T = max(t["sample_id"]) + 1, max(t["position"]) + 1
    grid = {k: torch.zeros(rows, T, dtype=torch.float32) for k in
            ("old_log_probs", "rollout_log_probs", "response_mask", "advantages")}
    for i, p, old, mu, a in zip(t["sample_id"], t["position"], t["trainer_logprob"],
                                t["engine_logprob"], t["advantage"]):
        for k, v in (("old_log_probs", old), ("rollout_log_probs", mu),
                     ("response_mask", 1.0), ("advantages", a)):
            grid[k][i, p] = v
    return DataProto.from_dict(tensors=grid)


@pytest.mark.budget(75)
@needs_verl
@pytest.mark.e2e
@pytest.mark.usefixtures("vllm_ready")
def test_the_plugins_figures_are_the_audits_on_a_real_vllm_rollout(tmp_path):
    """SmolLM2 sampled by vLLM, audited by `parity audit --rollouts` (fp32 trainer, ε 0.02, so
    that β alone clips some tokens); the same tokens as a verl DataProto give the plugin's
    figures, equal to the audit's."""
    from parity import testbed
    from parity.audit.command import audit
    from parity.config import AuditSettings
    from parity.models.loading import load_policy
    model_dir = testbed.resolve_model("smollm2-135m")
    model, tok = load_policy(model_dir)
    _rollout_file(tmp_path / "rollouts.jsonl", model.eval(), tok, model_dir)
    del model
    result = audit(AuditSettings(model=str(model_dir), rollouts=str(tmp_path / "rollouts.jsonl"),
                                 eps=0.02, progress=False), tmp_path / "audit", report=False)
    batch = _verl_batch_from_audit(tmp_path / "audit" / "tokens.parquet")
    figures = step_figures(batch, RunSettings(eps_low=0.02, eps_high=0.02))
    audited = result["metrics"]
    print(f"\n{'plugin figure':36} {'plugin':>12} {'audit':>12}  (audit name)")
    for ours, theirs in SAME_AS_THE_AUDIT.items():
        print(f"{'parity/' + ours:36} {figures.get('parity/' + ours, 'absent'):>12.6} "
              f"{audited.get(theirs, 'absent'):>12.6}  ({theirs})")
    for ours, theirs in SAME_AS_THE_AUDIT.items():
        # absent together (the slope, when every completion has one length) or equal
        assert ("parity/" + ours in figures) == (theirs in audited), ours
        if theirs in audited:
            assert figures["parity/" + ours] == pytest.approx(audited[theirs], rel=1e-5,
                                                              abs=1e-9), ours
    assert sum(k in audited for k in SAME_AS_THE_AUDIT.values()) >= 9
    assert result["tokens"] == int(batch.batch["response_mask"].sum()) > 100
    assert figures["parity/mismatch/beta_abs_mean"] > 0.005   # vLLM's bf16 against fp32
    assert figures["parity/clip/frac"] > 0


@pytest.mark.e2e
def test_docs_show_what_the_command_prints():
    """docs/verl.md's fp16 block is `parity recipes --for verl fp16`'s output."""
    from pathlib import Path
    p = subprocess.run([sys.executable, "-m", "parity", "recipes", "--for", "verl", "fp16"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "verl.md").read_text()
    assert p.stdout.strip() in doc


@needs_verl
@pytest.mark.parametrize("loss_mode,clip", [("gspo", "sequence"), ("vanilla", "token"),
                                            ("cispo", None)])
def test_the_plugin_judges_clips_as_the_runs_loss_does(loss_mode, clip):
    import verl
    from hydra import compose, initialize_config_dir
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
            "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    assert settings_of(cfg) == RunSettings(eps_low=0.2, eps_high=0.28, clip=clip)
