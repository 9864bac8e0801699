"""parity inside TRL's GRPOTrainer (parity/integrations/trl.py), with the installed trl, on CPU.

TRL computes its own clip statistics (`clip_ratio/region_mean`) from the ratio it really used;
parity computes `clip/frac` from ℓ_π, ℓ_s and ℓ_μ independently. Their agreement is the check
that the ratio source reached TRL's loss."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration test needs trl (pip install '.[test]')")

from parity.errors import ParityError  # noqa: E402
from parity.integrations.trl import ParityGRPOTrainer, ParityOptions  # noqa: E402

pytestmark = pytest.mark.e2e

PARITY_NAMES = ("clip/frac", "clip/phantom_frac", "clip/hidden_frac", "clip/alpha_frac",
                "mismatch/alpha_abs_mean", "mismatch/beta_abs_mean", "mismatch/beta_mean",
                "mismatch/kl_k3", "mismatch/kernel_gap_abs_mean", "sync/changed_frac")


def neg_length(prompts, completions, completion_ids, **_):
    return [-float(len(c)) for c in completion_ids]


def _trainer(model_dir, tmp_path, recipe="bf16-engine", steps=3, eps=0.2, lr=1e-4, parity=None,
             peft_config=None, **cfg):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity import testbed
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": p} for p in testbed.text_prompts(64)])
    base = dict(output_dir=str(tmp_path / "trl"), use_cpu=True, per_device_train_batch_size=16,
                num_generations=4, max_completion_length=16, max_steps=steps, logging_steps=1,
                report_to=[], learning_rate=lr, save_strategy="no", seed=0, epsilon=eps,
                bf16=False, disable_tqdm=True)
    args = GRPOConfig(**{**base, **cfg})
    return ParityGRPOTrainer(model=model, processing_class=tok, reward_funcs=neg_length,
                             args=args, train_dataset=ds, peft_config=peft_config,
                             parity=parity or ParityOptions.from_recipe(recipe))


def _steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "reward" in h]


@pytest.fixture(scope="module")
def bf16_engine_run(text_model, tmp_path_factory):
    t = _trainer(text_model, tmp_path_factory.mktemp("bf16"), steps=3)
    t.train()
    return t


def test_trl_log_carries_parity_metrics(text_model, tmp_path, capsys):
    """Must-show 1: TRL's GRPOTrainer, a few steps on a testbed model, parity's names in the
    log TRL prints and in its log history."""
    t = _trainer(text_model, tmp_path, steps=2)
    t.train()
    printed = capsys.readouterr().out
    with capsys.disabled():
        print("\nTRL log line:", next(line for line in printed.splitlines()
                                       if "clip/phantom_frac" in line)[:600], "...")
    for name in PARITY_NAMES:
        assert f"'{name}'" in printed, name
    steps = _steps(t)
    assert len(steps) == 2
    for h in steps:
        for name in PARITY_NAMES:
            assert math.isfinite(h[name]), (name, h[name])
        # TRL's own clip count and parity's agree: the engine ratio is what TRL clipped.
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)


def test_bf16_engine_has_a_precision_gap_and_tracks_the_weights(bf16_engine_run):
    steps = _steps(bf16_engine_run)
    for h in steps:
        # bf16 against fp32 on a testbed model: |β| of order 1e-3 (docs/diagnostics.md)
        assert 1e-4 < h["mismatch/beta_abs_mean"] < 5e-2
    # the engine copy is synced to the trainer's weights every step: unchanged at step 1, moved
    # after
    assert steps[0]["sync/changed_frac"] == 0.0
    assert all(h["sync/changed_frac"] > 0.01 for h in steps[1:])
    master = bf16_engine_run.accelerator.unwrap_model(bf16_engine_run.model)
    bf16_engine_run.engine.sync(master)
    for (name, p), (_, q) in zip(master.named_parameters(),
                                 bf16_engine_run.engine.model.named_parameters()):
        assert q.dtype == torch.bfloat16
        assert torch.equal(p.detach().to(torch.bfloat16), q), name


def test_shadow_ratio_removes_phantom_clipping_in_trl(text_model, tmp_path):
    """A tight clip range and a large step make phantom clipping visible with the engine ratio;
    the shadow ratio leaves only α-clipping, and TRL's own count equals it. Each batch serves
    two updates (num_iterations=2): in the first θ = θ_old and α is only the kernel gap, so
    only the second can α-clip."""
    runs = {}
    for recipe in ("bf16-engine", "bf16-shadow"):
        t = _trainer(text_model, tmp_path / recipe, recipe=recipe, steps=4, eps=0.01, lr=3e-3,
                     num_iterations=2)
        t.train()
        # every update's line, the second updates' too (TRL logs no reward there)
        runs[recipe] = [h for h in t.state.log_history if "clip/frac" in h]
        assert len(runs[recipe]) == 4
    assert sum(h["clip/phantom_frac"] for h in runs["bf16-engine"]) > 0.01
    for h in runs["bf16-engine"]:
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)
    for h in runs["bf16-shadow"]:
        assert h["clip/phantom_frac"] == 0.0 and h["clip/hidden_frac"] == 0.0
        assert h["clip_ratio/region_mean"] == pytest.approx(h["clip/alpha_frac"], abs=1e-6)
    assert sum(h["clip/alpha_frac"] for h in runs["bf16-shadow"]) > 0  # the clip still works


def test_shadow_reproduces_the_engine_at_theta_old(text_model, tmp_path):
    """At step 1 the shadow and the engine hold the same bf16 cast of the same weights, so
    α = ℓ_s − ℓ_μ is the kernel gap alone. The shadow must number a left-padded prompt's tokens
    as the engine did (`engines.positions`): TRL's forwards pass no position_ids, transformers
    then counts the padding, and bf16 rounds RoPE differently at shifted positions (docs/trl.md)."""
    t = _trainer(text_model, tmp_path, recipe="bf16-shadow", steps=1, lr=1e-6)
    left_pads = []
    shadow = t._shadow_logps

    def recording(input_ids, attention_mask, *args):
        left_pads.append(int((attention_mask[:, 0] == 0).sum()))
        return shadow(input_ids, attention_mask, *args)

    t._shadow_logps = recording
    t.train()
    assert sum(left_pads) > 0  # some prompts were left-padded: the case that went wrong
    gap = _steps(t)[0]["mismatch/kernel_gap_abs_mean"]
    print(f"\nkernel gap |alpha| at theta_old in TRL: {gap:.2e}")
    # parity's own shadow on this model: 1.0e-7 (bench/kernel_gap.py --model text-xs), the
    # KV-cache decode against the full forward; 1e-6 leaves it 10x room. Shadow positions
    # counting the padding gave 2.7e-3 here.
    assert gap < 1e-6


def test_independent_shadow_kernels_leave_a_gap_of_the_order_of_beta(text_model, tmp_path):
    """`shadow_kernels='independent'`: the shadow keeps the trainer's own attention, as a trainer
    scoring against vLLM must; in bf16 the other kernel's rounding alone then makes a kernel gap
    far above the engine-kernel shadow's (< 1e-6 above), of the order of β itself."""
    t = _trainer(text_model, tmp_path, steps=1, lr=1e-6, parity=ParityOptions.from_recipe(
        "bf16-shadow", shadow_kernels="independent"))
    master = t.accelerator.unwrap_model(t.model)
    assert t.shadow.config._attn_implementation == master.config._attn_implementation
    t.train()
    h = _steps(t)[0]
    print(f"\nindependent kernels: kernel gap {h['mismatch/kernel_gap_abs_mean']:.2e}, "
          f"|beta| {h['mismatch/beta_abs_mean']:.2e}")
    assert h["mismatch/kernel_gap_abs_mean"] > 1e-4
    assert h["mismatch/kernel_gap_abs_mean"] > 0.05 * h["mismatch/beta_abs_mean"]


@pytest.mark.usefixtures("vllm_ready")
def test_vllm_as_the_engine_and_its_scored_shadow_in_trl(text_model, tmp_path):
    """`engine='vllm'`: TRL's GRPOTrainer samples through vLLM's CPU build behind the same
    Engine interface. At step 1 (θ = θ_old) a shadow computed with parity's kernels misses
    vLLM's log-probs by vLLM's kernel gap; the shadow vLLM scores itself
    (`shadow_kernels='scored'`) has none. Either way the ratio reaches TRL's loss (its clip
    count is parity's)."""
    gaps = {}
    for kernels in ("engine", "scored"):
        t = _trainer(text_model, tmp_path / kernels, steps=1, lr=1e-6,
                     parity=ParityOptions.from_recipe("bf16-shadow", engine="vllm",
                                                      shadow_kernels=kernels))
        try:
            assert (t.shadow is None) == (kernels == "scored")
            t.train()
        finally:
            t.engine.close()
        h = _steps(t)[0]
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)
        gaps[kernels] = h["mismatch/kernel_gap_abs_mean"]
    print(f"\nkernel gap against vLLM in TRL: parity's kernels {gaps['engine']:.2e}, "
          f"vLLM-scored {gaps['scored']:.2e}")
    assert gaps["engine"] > 1e-4 and gaps["scored"] < 0.01 * gaps["engine"]
    with pytest.raises(ParityError, match="temperature 1"):
        _trainer(text_model, tmp_path / "t", temperature=0.7, parity=ParityOptions.from_recipe(
            "bf16-shadow", engine="vllm", shadow_kernels="scored"))


def test_fp16_fix_on_cpu(text_model, tmp_path, bf16_engine_run):
    """accelerate runs fp16=True on CPU as fp32 with no scaler; parity supplies both. The
    gradient is unscaled before clipping (grad_norm near the fp32 run's, not 65536x), and the
    precision gap falls well below bf16's."""
    t = _trainer(text_model, tmp_path, recipe="fp16", steps=3, fp16=True,
                 gradient_checkpointing=False)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    steps = _steps(t)
    assert all(h["loss/scale"] == 2.0**16 for h in steps)
    ref = _steps(bf16_engine_run)
    for h, r in zip(steps, ref):
        assert math.isfinite(h["grad_norm"]) and h["grad_norm"] < 20 * r["grad_norm"]
    beta16 = sum(h["mismatch/beta_abs_mean"] for h in steps) / len(steps)
    beta_bf16 = sum(h["mismatch/beta_abs_mean"] for h in ref) / len(ref)
    print(f"\n|beta| mean: fp16/fp16 {beta16:.2e}, bf16 engine/fp32 {beta_bf16:.2e} "
          f"({beta_bf16 / beta16:.1f}x)")
    assert 0 < beta16 < beta_bf16 / 3
    moved = [n for n, p in t.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved and all(torch.isfinite(p).all() for p in t.model.parameters())


def test_bad_setups_are_refused(text_model, tmp_path):
    with pytest.raises(ParityError, match="GRPOConfig applies|only to vLLM"):
        ParityOptions.from_recipe("tis")
    with pytest.raises(ParityError, match="epsilon"):
        ParityOptions.from_recipe("wide-eps")
    with pytest.raises(ParityError, match="engine_dtype"):
        ParityOptions(engine_dtype="fp8").validate()
    with pytest.raises(ParityError, match=r"set GRPOConfig\(fp16=True\)"):
        _trainer(text_model, tmp_path, recipe="fp16")
    with pytest.raises(ParityError, match="gradient_checkpointing=False"):
        _trainer(text_model, tmp_path, recipe="fp16", fp16=True)


def test_trl_peft_config_trains_adapters_that_the_engine_samples_from(text_model, tmp_path):
    """TRL wraps the model in peft from `peft_config`; parity's engine then samples from the
    adapted weights, merged into one bf16 weight per layer, and its diagnostics reach TRL's
    log."""
    from peft import LoraConfig

    from parity import lora
    trainer = _trainer(text_model, tmp_path, steps=2, lr=1e-2,
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    master = trainer.accelerator.unwrap_model(trainer.model)
    assert lora.is_lora(master)
    assert not lora.is_lora(trainer.engine.model)  # merged
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == 2
    assert all(s["mismatch/beta_abs_mean"] > 0 for s in steps)
    assert steps[-1]["sync/changed_frac"] > 0  # the adapters moved and the engine followed
    assert all("lora_" in n for n, p in master.named_parameters() if p.requires_grad)
