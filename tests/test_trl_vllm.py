"""ParityGRPOTrainer on TRL's own vLLM (`GRPOConfig(use_vllm=True)`,
parity/integrations/trl_vllm.py): real TRL, vLLM's CPU build, the testbed's `text-xs`.

TRL's vLLM samples and TRL keeps its log-probs; parity's figures must show that ℓ_μ is vLLM's:
an fp32 vLLM against an fp32 trainer leaves only the two implementations' rounding between
ℓ_π and ℓ_μ, a bf16 vLLM a gap of bf16's size."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration test needs trl (pip install '.[test]')")

from parity.errors import ParityError  # noqa: E402
from parity.integrations.trl import ParityOptions  # noqa: E402
from test_trl import PARITY_NAMES, _steps, _trainer  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vllm_ready")]

# TRL's importance weights would multiply a ratio that already holds ℓ_μ (parity turns them
# off with one line otherwise: test_a_stock_grpo_config_with_vllm_runs_...).
VLLM = dict(use_vllm=True, vllm_importance_sampling_correction=False)


def _run(model_dir, tmp_path, recipe, steps, lr=1e-4, **kw):
    """A colocated run; its vLLM is stopped after it (TRL keeps it for the process's life)."""
    parity = ParityOptions.from_recipe(recipe, **kw.pop("parity", {}))
    t = _trainer(model_dir, tmp_path, steps=steps, lr=lr, parity=parity, vllm_mode="colocate",
                 **VLLM, **kw)
    try:
        assert t.engine is None and t.vllm_generation.served() == (parity.engine_dtype,
                                                                    "processed_logprobs")
        t.train()
    finally:
        t.vllm_generation.close()
    return t


def test_trls_colocated_vllm_samples_and_parity_measures_it(text_model, tmp_path, capsys):
    """fp32 on both sides: β is 0 by construction, and ℓ_π − ℓ_μ (the kernel gap at
    θ = θ_old) is two fp32 implementations' rounding, also at step 2, after TRL's sync (parity's
    reload on the CPU) moved vLLM to the updated weights. A bf16 vLLM under an fp32 trainer:
    |β| of bf16's size."""
    t = _run(text_model, tmp_path / "fp32", "fp32", steps=2, lr=3e-3)
    printed = capsys.readouterr().out
    for name in PARITY_NAMES:
        if name != "sync/changed_frac":   # counted on the shadow's copy: none at fp32/fp32
            assert f"'{name}'" in printed, name
    steps = _steps(t)
    assert len(steps) == 2
    for h in steps:
        assert h["mismatch/beta_abs_mean"] == 0.0
        assert 0 < h["mismatch/kernel_gap_abs_mean"] < 1e-4, h["mismatch/kernel_gap_abs_mean"]
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)
    print(f"\nfp32 vLLM, fp32 trainer: kernel gap {steps[0]['mismatch/kernel_gap_abs_mean']:.1e}"
          f", {steps[1]['mismatch/kernel_gap_abs_mean']:.1e} after the sync")

    b = _run(text_model, tmp_path / "bf16", "bf16-engine", steps=1)
    h = _steps(b)[0]
    print(f"bf16 vLLM, fp32 trainer: |beta| {h['mismatch/beta_abs_mean']:.2e}, kernel gap "
          f"{h['mismatch/kernel_gap_abs_mean']:.2e}, phantom {h['clip/phantom_frac']:.3f}")
    assert 1e-3 < h["mismatch/beta_abs_mean"] < 5e-2
    assert h["sync/changed_frac"] == 0.0 and math.isfinite(h["mismatch/kl_k3"])
    assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)


def test_the_shadow_scored_by_trls_colocated_vllm_has_no_kernel_gap(text_model, tmp_path):
    """`shadow_kernels='scored'`: TRL's vLLM scores the loss's sequences itself, so at
    θ = θ_old α = ℓ_s − ℓ_μ is 0 up to float32 rounding, and β = ℓ_π − ℓ_s is bf16's gap."""
    t = _run(text_model, tmp_path, "bf16-shadow", steps=1,
             parity={"shadow_kernels": "scored"})
    h = _steps(t)[0]
    print(f"\nscored by TRL's vLLM: kernel gap {h['mismatch/kernel_gap_abs_mean']:.1e}, "
          f"|beta| {h['mismatch/beta_abs_mean']:.2e}")
    assert t.shadow is None
    assert h["mismatch/kernel_gap_abs_mean"] < 1e-5
    assert 1e-3 < h["mismatch/beta_abs_mean"] < 5e-2
    assert h["clip/phantom_frac"] == 0.0 and h["clip/hidden_frac"] == 0.0


def test_a_stock_grpo_config_with_vllm_runs_and_says_what_parity_changed(text_model,
                                                                          tmp_path, caplog):
    """TRL's defaults bf16=True and vllm_importance_sampling_correction=True: the first becomes
    the recipe's fp32 trainer; the second would weight a ratio that already holds vLLM's ℓ_μ by
    exp(ℓ_old − ℓ_μ) again, and is turned off. One line each, and one step runs."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity.integrations.trl import ParityGRPOTrainer
    from parity.tasks.data import text_prompts
    from test_trl import neg_length
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, use_vllm=True,
                      vllm_mode="colocate", max_steps=1, max_completion_length=16, report_to=[])
    ds = datasets.Dataset.from_list([{"prompt": p} for p in text_prompts(16)])
    with caplog.at_level("WARNING", logger="parity.integrations.trl_config"):
        t = ParityGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32),
            processing_class=AutoTokenizer.from_pretrained(text_model), reward_funcs=neg_length,
            args=args, train_dataset=ds, parity=ParityOptions.from_recipe("bf16-shadow"))
    try:
        t.train()
    finally:
        t.vllm_generation.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("parity.")]
    print("\n" + "\n".join(said))
    assert said == [
        "parity: GRPOConfig bf16=True set to False: recipe bf16-shadow trains in fp32",
        "parity: GRPOConfig vllm_importance_sampling_correction=True set to False: recipe "
        "bf16-shadow puts vLLM's log-probs in the ratio (ratio_source=shadow), which TRL's "
        "correction would weight by exp(l_old - l_mu) again"]
    assert t.state.global_step == 1 and math.isfinite(_steps(t)[0]["mismatch/beta_abs_mean"])
    assert not t.args.vllm_importance_sampling_correction


@pytest.mark.budget(45)
def test_a_server_with_raw_logprobs_is_refused_in_one_line(text_model, tmp_path):
    """A server started with raw log-probs (before temperature and truncation): ℓ_μ would not
    be the sampling distribution's. The line names the flag that fixes it; so does the line
    for a server in another precision than the recipe's."""
    from parity.integrations.weight_sync import dev_server
    with dev_server(text_model, "bf16", tmp_path / "server.log",
                    extra=["--logprobs-mode", "raw_logprobs"]) as url:
        with pytest.raises(ParityError, match=r"returns raw_logprobs.*--logprobs-mode "
                                              r"processed_logprobs") as e:
            _trainer(text_model, tmp_path, steps=1, vllm_mode="server",
                     vllm_server_base_url=url, **VLLM)
        assert "\n" not in str(e.value)
        with pytest.raises(ParityError, match=r"expect a fp32 engine .* serves bf16: restart "
                                              r"it with --dtype float32"):
            _trainer(text_model, tmp_path, recipe="fp32", steps=1, vllm_mode="server",
                     vllm_server_base_url=url, **VLLM)


@pytest.mark.budget(60)
def test_trls_server_mode_with_parity_syncing_through_a_directory(text_model, tmp_path):
    """`vllm_mode='server'` without CUDA: TRL samples from the server, and parity syncs the
    weights through a directory (TRL's NCCL sync needs CUDA) and checks every sync against a
    probe. Step 2 samples from the updated weights: the sync changed them and the probe moved.
    The server scores the shadow itself with no kernel gap."""
    from parity.integrations.weight_sync import dev_server
    with dev_server(text_model, "bf16", tmp_path / "server.log") as url:
        t = _trainer(text_model, tmp_path / "engine", recipe="bf16-engine", steps=2, lr=3e-3,
                     vllm_mode="server", vllm_server_base_url=url, **VLLM)
        assert t.engine is None and t.vllm_generation.transfer is not None
        t.train()
        scored = _trainer(text_model, tmp_path / "scored", steps=1, vllm_mode="server",
                          vllm_server_base_url=url, **VLLM, parity=ParityOptions.from_recipe(
                              "bf16-shadow", shadow_kernels="scored"))
        scored.train()
    h = _steps(scored)[0]
    assert h["mismatch/kernel_gap_abs_mean"] < 1e-5 and 1e-3 < h["mismatch/beta_abs_mean"] < 5e-2
    steps = _steps(t)
    for h in steps:
        assert 1e-3 < h["mismatch/beta_abs_mean"] < 5e-2
        assert h["sync/probe_gap_abs_mean"] < 0.02
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)
    assert steps[0]["sync/changed_frac"] == 0.0 and steps[1]["sync/changed_frac"] > 0.01
    assert steps[1]["sync/probe_moved_abs_mean"] > 0
    print(f"\nserver mode: |beta| {steps[0]['mismatch/beta_abs_mean']:.2e}, probe gap "
          f"{steps[0]['sync/probe_gap_abs_mean']:.1e}, kernel gap "
          f"{steps[0]['mismatch/kernel_gap_abs_mean']:.1e}")
