"""parity inside TRL's GRPOTrainer (parity/integrations/trl.py), with the installed trl, on CPU.

TRL computes its own clip statistics (`clip_ratio/region_mean`) from the ratio it really used;
parity computes `clip/frac` from ℓ_π, ℓ_s and ℓ_μ independently. Their agreement is the check
that the ratio source reached TRL's loss."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

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
             peft_config=None, model=None, reward=neg_length, **cfg):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity.tasks.data import text_prompts
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": p} for p in text_prompts(64)])
    base = dict(output_dir=str(tmp_path / "trl"), use_cpu=True, per_device_train_batch_size=16,
                num_generations=4, max_completion_length=16, max_steps=steps, logging_steps=1,
                report_to=[], learning_rate=lr, save_strategy="no", seed=0, epsilon=eps,
                bf16=False, disable_tqdm=True)
    args = GRPOConfig(**{**base, **cfg})
    return ParityGRPOTrainer(model=model, processing_class=tok, reward_funcs=reward,
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
    # against the reference run's largest norm: a step whose groups all tie has a zero gradient
    most = max(r["grad_norm"] for r in ref)
    for h in steps:
        assert math.isfinite(h["grad_norm"]) and h["grad_norm"] < 20 * most
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
    with pytest.raises(ParityError, match="min_p before top_p"):
        _trainer(text_model, tmp_path, min_p=0.1, top_p=0.9,
                 parity=ParityOptions.from_recipe("bf16-engine", engine="vllm"))


@pytest.mark.parametrize("field, value, said", [
    ("min_p", 1.5, "GRPOConfig.min_p=1.5 must be <= 1"),
    ("repetition_penalty", 0.0, "GRPOConfig.repetition_penalty=0.0 must be a finite number > 0"),
    ("repetition_penalty", -1.0, "GRPOConfig.repetition_penalty=-1.0 must be a finite number"),
    ("temperature", 0.0, "GRPOConfig.temperature=0 is greedy decoding: it draws no token"),
    ("min_p", math.nan, "GRPOConfig.min_p=nan must be a finite number >= 0 and <= 1"),
])
def test_sampling_arguments_transformers_refuses_are_refused_at_construction(
        field, value, said, text_model, tmp_path):
    """Each value TRL's own GRPOTrainer refuses through transformers, before any step (each
    trained with NaN weights, or stopped in a ZeroDivisionError, before)."""
    with pytest.raises(ParityError) as e:
        _trainer(text_model, tmp_path, **{field: value})
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_top_p_0_samples_the_likeliest_token_and_trains_with_finite_weights(text_model,
                                                                           tmp_path):
    """transformers keeps the likeliest token at top_p=0 (min_tokens_to_keep=1); parity's
    engine samples it with probability 1 (ℓ_μ = 0 for every token), and the step is finite."""
    t = _trainer(text_model, tmp_path, steps=1, top_p=0.0)
    mus = []
    generate = t.engine.generate
    t.engine.generate = lambda *a, **k: mus.append(r := generate(*a, **k)) or r
    t.train()
    h = [x for x in t.state.log_history if "grad_norm" in x][0]
    assert math.isfinite(h["grad_norm"]) and h["train/skipped_updates"] == 0
    assert mus and all(torch.equal(r.engine_logprobs, torch.zeros_like(r.engine_logprobs))
                       for r in mus)
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


@pytest.mark.parametrize("where", ["config", "generation_kwargs"])
def test_top_p_above_1_trains_as_trls_own_trainer_does(where, text_model, tmp_path, caplog):
    """transformers applies no top-p cut above 1, so TRL's own GRPOTrainer trains with
    top_p=1.5; parity samples and scores the whole distribution there too, and says so once
    (refused with 'must be <= 1' before)."""
    cfg = {"top_p": 1.5} if where == "config" else {"generation_kwargs": {"top_p": 1.5}}
    with caplog.at_level("WARNING", logger="parity.integrations.trl_config"):
        t = _trainer(text_model, tmp_path, steps=1, per_device_train_batch_size=4,
                     max_completion_length=8, **cfg)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("parity.")]
    assert len(said) == 1 and "top_p=1.5 set to 1.0" in said[0], said
    assert t.sampling.top_p == 1.0
    t.train()
    assert t.state.global_step == 1 and _steps(t)[0]["train/skipped_updates"] == 0
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_a_stock_grpo_config_runs_and_one_line_says_what_parity_changed(text_model, tmp_path,
                                                                       caplog):
    """TRL's default bf16=True against a recipe that trains in fp32: set to False, said once;
    the user's GRPOConfig itself is left alone. The fp16 recipe gets fp16=True instead."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity.tasks.data import text_prompts
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=1,
                      max_completion_length=16, report_to=[])
    assert args.bf16 is True
    ds = datasets.Dataset.from_list([{"prompt": p} for p in text_prompts(16)])
    with caplog.at_level("WARNING", logger="parity.integrations.trl_config"):
        t = ParityGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32),
            processing_class=AutoTokenizer.from_pretrained(text_model), reward_funcs=neg_length,
            args=args, train_dataset=ds, parity=ParityOptions.from_recipe("bf16-shadow"))
        t.train()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("parity.")]
    print("\n" + "\n".join(said))
    assert said == ["parity: GRPOConfig bf16=True set to False: recipe bf16-shadow trains in "
                    "fp32"]
    assert args.bf16 is True and t.args.bf16 is False and t.trainer_dtype == "fp32"
    assert t.state.global_step == 1 and math.isfinite(_steps(t)[0]["mismatch/beta_abs_mean"])
    caplog.clear()
    with caplog.at_level("WARNING", logger="parity.integrations.trl_config"):
        t = _trainer(text_model, tmp_path, recipe="fp16", bf16=True)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("parity.")] == [
        "parity: GRPOConfig bf16=True set to False and fp16=False set to True: recipe fp16 "
        "trains in fp16"]
    assert t.trainer_dtype == "fp16" and t.accelerator.scaler is not None


def test_prompts_that_leave_no_room_for_the_completion_are_refused_at_construction(
        text_model, tmp_path):
    """As `parity train` refuses them (tasks.check_fits), before TRL would run past the
    model's 256 positions mid-training."""
    with pytest.raises(ParityError, match=r"^train_dataset row 0: prompt is \d+ tokens; with "
                                          r"max_completion_length=256 it exceeds the model's "
                                          r"context of 256 positions$"):
        _trainer(text_model, tmp_path, max_completion_length=256)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(text_model)
    import datasets

    from parity.tasks.data import text_prompts
    long = tok.decode(tok(" ".join(text_prompts(64)))["input_ids"][:250])
    t = _trainer(text_model, tmp_path, max_completion_length=16)
    with pytest.raises(ParityError, match=r"^eval_dataset row 1: prompt is \d+ tokens; with "
                                          r"max_completion_length=16"):
        ParityGRPOTrainer(model=t.model, processing_class=tok, reward_funcs=neg_length,
                          args=t.args, train_dataset=t.train_dataset,
                          eval_dataset=datasets.Dataset.from_list([{"prompt": "x"},
                                                                   {"prompt": long}]),
                          parity=ParityOptions.from_recipe("bf16-engine"))


def test_trl_peft_config_trains_adapters_that_the_engine_samples_from(text_model, tmp_path):
    """TRL wraps the model in peft from `peft_config`; parity's engine then samples from the
    adapted weights, merged into one bf16 weight per layer, and its diagnostics reach TRL's
    log."""
    from peft import LoraConfig

    from parity.models import lora
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


def odd_tokens(prompts, completions, completion_ids, **_):
    # a random model rarely ends a completion early: its lengths would not vary, its tokens do
    return [float(sum(t % 2 for t in c)) for c in completion_ids]


def _tied_model(model_dir):
    """The test-size Llama with its head tied to its input embedding, as SmolLM2, Qwen2.5 and
    Llama-3.2 ship."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def _hooks(module: torch.nn.Module) -> list[str]:
    """Every hook, and every per-instance method not bound to its own module, in `module`."""
    out = []
    for name, m in module.named_modules():
        out += [f"{name}.{k}" for k in ("_forward_hooks", "_forward_pre_hooks",
                                        "_forward_hooks_with_kwargs", "_backward_hooks",
                                        "_backward_pre_hooks") if getattr(m, k)]
        out += [f"{name}.{k}" for k, v in vars(m).items() if callable(v)
                and hasattr(type(m), k) and getattr(v, "__self__", None) is not m]
    return out


@pytest.mark.parametrize("engine_dtype", ["bf16", "fp16"])
def test_a_tied_model_with_an_fp32_head_trains(text_model, tmp_path, engine_dtype):
    """GRPOConfig(cast_lm_head_to_fp32=True) on tied embeddings: TRL hooks the embedding to cast
    its output to the model's own dtype (fp32) and replaces the head's forward with a closure
    over the master's head. Copies that kept them fed fp32 into the copy's bf16/fp16 layers
    (`expected m1 and m2 to have the same dtype`). The engine's and the shadow's copies keep
    none of them: only parity's own methods, bound to the copy."""
    t = _trainer(text_model, tmp_path, steps=1, model=_tied_model(text_model), reward=odd_tokens,
                 cast_lm_head_to_fp32=True,
                 parity=ParityOptions(engine_dtype=engine_dtype, ratio_source="shadow"))
    master = t.accelerator.unwrap_model(t.model)
    assert master.model.embed_tokens._forward_hooks  # TRL's cast is on the master
    assert _hooks(t.engine.model) == [] and _hooks(t.shadow) == []
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    h = _steps(t)[0]
    # the engine and the shadow: the same weights and arithmetic at θ = θ_old
    assert h["mismatch/kernel_gap_abs_mean"] < 1e-6
    assert 0 < h["mismatch/beta_abs_mean"] < 5e-2 and math.isfinite(h["grad_norm"])
    assert any(not torch.equal(p.detach(), before[n]) for n, p in t.model.named_parameters())


def test_fp16_runs_under_trls_default_gradient_checkpointing(text_model, tmp_path):
    """TRL checkpoints by default. The recomputation in backward runs outside the fp16
    emulation unless parity puts it back in; then the step is the one without checkpointing,
    to the bit."""
    runs = {}
    for checkpointing in (True, False):
        extra = {} if checkpointing else {"gradient_checkpointing": False}
        t = _trainer(text_model, tmp_path / str(checkpointing), recipe="fp16", steps=1,
                     fp16=True, **extra)
        assert t.args.gradient_checkpointing is checkpointing
        assert t.parity.cpu_fp16 == "emulate"
        t.train()
        runs[checkpointing] = (_steps(t)[0], {n: p.detach().clone()
                                              for n, p in t.model.named_parameters()})
    (h, w), (h0, w0) = runs[True], runs[False]
    assert h["grad_norm"] > 0 and h["grad_norm"] == h0["grad_norm"]
    assert h["mismatch/beta_abs_mean"] == h0["mismatch/beta_abs_mean"]
    assert all(torch.equal(w[n], w0[n]) for n in w)


def test_fp16_under_reentrant_checkpointing_runs_natively_and_says_so(text_model, tmp_path,
                                                                     caplog):
    t = _trainer(text_model, tmp_path, recipe="fp16", steps=1, fp16=True,
                 gradient_checkpointing_kwargs={"use_reentrant": True})
    assert t.parity.cpu_fp16 == "native"
    said = [r.getMessage() for r in caplog.records if "reentrant" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]


def _bypass_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("parity") and "without model.generate" in r.getMessage()]


def test_what_the_engine_cannot_honour_is_named_once(text_model, tmp_path, caplog):
    """parity's engine never calls model.generate: a patched generate and the logits processors
    transformers would build from the generation config are named, once, in one line. A plain
    setup says nothing."""
    from transformers import AutoModelForCausalLM
    _trainer(text_model, tmp_path / "plain", steps=1).train()
    assert _bypass_warnings(caplog) == []
    model = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    model.generate = lambda *a, **k: None
    model.generation_config.no_repeat_ngram_size = 3
    _trainer(text_model, tmp_path / "hooked", steps=2, model=model, temperature=0.9,
             generation_kwargs={"suppress_tokens": [5], "temperature": 0.7}).train()
    said = _bypass_warnings(caplog)
    assert len(said) == 1 and "\n" not in said[0]
    for what in ("patched model.generate", "no_repeat_ngram_size=3", "suppress_tokens=[5]",
                 "temperature=0.7 (parity samples with GRPOConfig's 0.9)"):
        assert what in said[0], what
    with pytest.raises(ParityError, match="beam search"):
        _trainer(text_model, tmp_path / "beams", generation_kwargs={"num_beams": 2})


def _figures(t: dict[str, torch.Tensor], eps: float) -> dict[str, float]:
    """Some of parity's figures, from flat float64 tokens (ℓ_π, ℓ_s, ℓ_μ, A) by their
    definitions (docs/diagnostics.md), with the engine ratio's clip as TRL's loss applies it."""
    r, d, beta = (t["pi"] - t["mu"]).exp(), t["pi"] - t["mu"], t["pi"] - t["s"]
    clipped = ((r < 1 - eps) & (t["adv"] < 0)) | ((r > 1 + eps) & (t["adv"] > 0))
    pdiff = t["pi"].exp() - t["mu"].exp()
    return {"clip/frac": float(clipped.double().mean()),
            "mismatch/beta_abs_mean": float(beta.abs().mean()),
            "mismatch/beta_abs_max": float(beta.abs().max()),
            "mismatch/kernel_gap_abs_mean": float((t["s"] - t["mu"]).abs().mean()),
            "mismatch/kl_k3": float((d.exp() - d - 1).mean()),
            "mismatch/prob_diff_max": float(pdiff.max()),
            "mismatch/prob_diff_min": float(pdiff.min())}


def _tokens(call: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    m = call["mask"] > 0
    adv = call["adv"] if call["adv"].dim() == 2 else call["adv"][:, None]
    return {"pi": call["pi"][m].double(), "s": call["s"][m].double(),
            "mu": call["mu"][m].double(), "adv": adv.expand_as(m)[m].double()}


def test_two_ranks_log_the_figures_of_all_their_tokens(text_model, tmp_path):
    """Two processes on gloo (torchrun), each sampling and scoring its own completions
    (tests/trl_ranks.py). parity's figures in TRL's log are those of both ranks' tokens
    together, as one process holding them all computes them: token means weighted by each
    rank's tokens, maxima and minima over all; the same on both ranks; and clip/frac equals
    TRL's own clip count, which TRL reduces over the ranks the same way."""
    eps = 0.002  # as tests/trl_ranks.py sets it: some tokens clip
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(Path(__file__).parent / "trl_ranks.py"),
                        str(text_model), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    logs = [[h for h in r["log"] if "clip/frac" in h] for r in ranks]
    assert len(logs[0]) == len(logs[1]) == 2
    for k in range(2):
        own = [_tokens(r["calls"][k]) for r in ranks]
        both = {key: torch.cat([o[key] for o in own]) for key in own[0]}
        want = _figures(both, eps)
        for name, v in want.items():
            assert logs[0][k][name] == pytest.approx(v, rel=1e-6, abs=1e-12), (k, name)
            assert logs[1][k][name] == logs[0][k][name], (k, name)
        assert logs[0][k]["clip/frac"] == pytest.approx(logs[0][k]["clip_ratio/region_mean"],
                                                        abs=1e-6)
        # the ranks' own figures differ from the pooled ones: the check tells them apart
        mine = _figures(own[0], eps)
        assert mine["mismatch/beta_abs_mean"] != pytest.approx(want["mismatch/beta_abs_mean"],
                                                               rel=1e-6)
    assert sum(h["clip/frac"] for h in logs[0]) > 0


def test_trls_sampling_arguments_are_the_engines_and_the_ratios(text_model, tmp_path):
    """GRPOConfig's top_p, top_k, min_p and repetition_penalty shape the distribution the engine
    draws from. TRL's fused head scores log_softmax(logits / T) alone, which would put the cut
    mass and the penalty into ℓ_π − ℓ_μ; parity scores ℓ_π, and ℓ_s, under the engine's
    distribution. At step 1 (θ = θ_old) an fp32 trainer's ℓ_π is then the fp32 engine's ℓ_μ up to
    kernel noise, and the bf16 shadow's ℓ_s the bf16 engine's."""
    from parity.logprobs import Sampling
    sampling = dict(temperature=0.9, top_p=0.95, top_k=30, min_p=0.02, repetition_penalty=1.3)
    t = _trainer(text_model, tmp_path / "fp32", recipe="fp32", steps=1, lr=1e-6, **sampling)
    assert t.sampling == Sampling(0.9, 0.95, 30, 0.02, 1.3)
    t.train()
    h = _steps(t)[0]
    print(f"\nfp32, processed sampling: kl_k1 {h['mismatch/kl_k1']:.2e}, "
          f"|p_pi - p_mu| {h['mismatch/prob_diff_abs_mean']:.2e}")
    assert abs(h["mismatch/kl_k1"]) < 1e-5 and h["mismatch/prob_diff_abs_mean"] < 1e-5
    t = _trainer(text_model, tmp_path / "bf16", recipe="bf16-shadow", steps=1, lr=1e-6,
                 **sampling)
    t.train()
    h = _steps(t)[0]
    assert h["mismatch/kernel_gap_abs_mean"] < 1e-6
    assert 1e-4 < h["mismatch/beta_abs_mean"] < 5e-2
    assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)


def test_a_row_of_positive_engine_log_probs_is_left_out_counted_and_named_once(caplog):
    """ℓ_μ from TRL's vLLM or a server holding logits by mistake, one row of 2.0 to 9.0: the
    micro-batch's token figures are those of the micro-batch without that row (sliced off),
    and the guard names them in one warning and counts them in every log line from then on."""
    import logging

    from parity import metric_names as mn
    from parity.integrations.trl import micro_batch_diagnostics
    from parity.integrations.trl_updates import UpdateGuard
    from parity.runs.finite import LeftOut
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    pi = -torch.rand(B, T, generator=g) * 3
    s = (pi + 0.01 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    mu = (pi + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    mask, adv = torch.ones(B, T), torch.randn(B, generator=g)
    mask[2, 4:] = 0.0
    logits = mu.clone()
    logits[0] = torch.linspace(2.0, 9.0, T)
    kw = dict(ratio_source="engine", sequence=False, first=True)
    diag, left, _ = micro_batch_diagnostics(pi, s, logits, None, adv, mask, 0.2, 0.2, **kw)
    sliced, none, _ = micro_batch_diagnostics(pi[1:], s[1:], mu[1:], None, adv[1:], mask[1:],
                                              0.2, 0.2, **kw)
    assert left == LeftOut(positive=T, largest=9.0) and not none
    # per completion: the emptied row is still one, of no token (tests/test_verl.py)
    per_completion = {mn.SEQ_LOG_RATIO_MEAN, mn.SEQ_LOG_RATIO_SLOPE}
    got, want = ({k: v for k, v in d.metrics().items() if k not in per_completion}
                 for d in (diag, sliced))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    guard = UpdateGuard(trainer=None, limit=0)      # its trainer is for the optimizer's step
    lines: list[dict] = [{}, {}]
    with caplog.at_level(logging.WARNING, logger="parity.integrations.trl_updates"):
        guard.left_out(left)
        guard.add_to(lines[0])
        guard.left_out(LeftOut())
        guard.add_to(lines[1])
    assert lines == [{mn.SKIPPED_UPDATES: 0, mn.POSITIVE_TOKENS: T},
                     {mn.SKIPPED_UPDATES: 0, mn.POSITIVE_TOKENS: 0}]
    assert [r.getMessage() for r in caplog.records] == [
        f"parity: {T} token log-probs from the engine (l_mu) or the trainer's forwards are "
        "positive, up to 9: these look like logits, not log-probs (a log-prob is <= 0), and are "
        "left out of every figure (counted in mismatch/positive_tokens)"]


def test_on_the_cpu_the_trainer_runs_the_bf16_products_parity_train_runs(text_model, tmp_path,
                                                                         monkeypatch):
    """On a CPU without bf16 instructions a TRL user gets parity's emulated bf16 products, as
    `parity train` there (docs/performance.md); PARITY_CPU_BF16 forces each path here."""
    from parity import cpu_bf16
    for setting, emulated in (("emulate", True), ("native", False)):
        monkeypatch.setenv(cpu_bf16.ENV, setting)
        with cpu_bf16.kernels(emulate=False):
            _trainer(text_model, tmp_path / setting, steps=1)
            assert cpu_bf16.active() is emulated, setting
