"""LoRA runs: only the adapters train and are saved, the engine and the shadow see the adapted
weights (merged in fp32 and cast once, or cast apart), every recipe runs, a resumed run
continues exactly, the audit takes an adapter, TRL's peft_config works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity.config import RECIPES, make_config
from parity.errors import ParityError
from parity.models import lora
from parity.trainer import train

pytestmark = pytest.mark.e2e

SMALL = dict(model="arith-xs", task="arith", prompts_per_step=4, samples_per_prompt=4,
             lora_rank=4, lr=1e-2, progress=False, threads=1)
TIMING = ("time/", "throughput/")


def _run(tmp_path: Path, name: str, on_model=None, **kw) -> tuple[Path, list[dict]]:
    out = train(make_config({**SMALL, "out": str(tmp_path / name), **kw}), on_model)
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_only_adapters_train_and_only_they_are_saved(tmp_path, arith_model):
    seen = {}

    def keep(model):
        seen["model"] = model
        seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, rows = _run(tmp_path, "a", on_model=keep, steps=3)
    model = seen["model"]
    for n, p in model.named_parameters():
        if "lora_" not in n:  # the base never moves
            assert torch.equal(p.detach(), seen["before"][n]), n
        assert p.requires_grad == ("lora_" in n), n
    assert any("lora_B" in n and not torch.equal(p.detach(), seen["before"][n])
               for n, p in model.named_parameters())
    ckpt = out / "checkpoints" / "step-3"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json",
            "engine_adapters.safetensors"} <= names
    assert not names & {"model.safetensors", "engine.safetensors"}
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    state = torch.load(ckpt / "train.pt", weights_only=True)["optimizer"]["state"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(state) == len(trainable)  # Adam's moments for the adapters alone
    assert rows[1]["sync/changed_frac"] > 0  # the engine follows the adapters


def test_resume_of_a_lora_run_equals_the_uninterrupted_run(tmp_path, arith_model):
    from parity.cli import main
    run = ["--model", "arith-xs", "--task", "arith", "--prompts-per-step", "4",
           "--samples-per-prompt", "4", "--lora-rank", "4", "--lr", "1e-2", "--threads", "1",
           "--no-progress", "--save-every", "1"]
    assert main(["train", *run, "--steps", "2", "--out", str(tmp_path / "a")]) == 0
    assert main(["train", "--resume", str(tmp_path / "a"), "--steps", "4"]) == 0
    assert main(["train", *run, "--steps", "4", "--out", str(tmp_path / "b")]) == 0
    rows = [[{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)}
             for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("a", "b")]
    assert rows[0] == rows[1]
    assert rows[1][-1]["sync/changed_frac"] > 0


def _weights(model):
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("merge", [True, False])
def test_the_engine_holds_the_adapted_weights_cast_as_chosen(merge, arith_model):
    """Merged: each adapted layer's weight is W + (alpha/r) B A, summed exactly (float64 here)
    and rounded once to bf16. Unmerged: the base and each adapter rounded to bf16 apart."""
    from parity.models.loading import load_policy
    from parity.models.precision import low_precision_copy
    model, _ = load_policy(arith_model)
    torch.manual_seed(0)
    peft_model = lora.wrap(model, 4, 8.0, "all-linear", merge, torch.float32)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at 0; give the adapters something to add
    engine = low_precision_copy(peft_model, "bf16")
    eng = _weights(engine)
    base = peft_model.get_base_model()
    from peft.tuners.lora import LoraLayer
    checked = 0
    for name, mod in base.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        W = mod.base_layer.weight.double()
        A, B = mod.lora_A["default"].weight.double(), mod.lora_B["default"].weight.double()
        if merge:
            exact = (W + 2.0 * B @ A).to(torch.bfloat16)   # alpha / r = 8 / 4
            got = eng[f"{name}.weight"]
            assert (got == exact).double().mean() > 0.999, name
        else:
            prefix = f"base_model.model.{name}"
            assert torch.equal(eng[f"{prefix}.base_layer.weight"], W.to(torch.bfloat16))
            assert torch.equal(eng[f"{prefix}.lora_A.default.weight"], A.to(torch.bfloat16))
        checked += 1
    assert checked == 14  # 2 layers x (q, k, v, o, gate, up, down)


def test_an_fp32_engine_with_lora_agrees_with_the_trainer(tmp_path, arith_model):
    """With fp32 on both sides the engine's merged weights give the trainer's log-probs up to
    the rounding of the merge: after the adapters have moved, no mismatch beyond kernel noise."""
    _, rows = _run(tmp_path, "fp32", recipe="fp32", steps=3)
    assert rows[-1]["sync/changed_frac"] > 0
    for r in rows:
        assert abs(r["mismatch/kl_k1"]) < 1e-4 and r["mismatch/beta_abs_mean"] < 1e-3


# every recipe but those whose kernels refuse LoRA (bitwise: tests/test_invariant.py)
@pytest.mark.parametrize("recipe", [r for r, e in RECIPES.items()
                                    if e.settings["kernels"] == "default"])
def test_every_recipe_runs_with_lora(recipe, tmp_path, arith_model):
    _, rows = _run(tmp_path, recipe, recipe=recipe, steps=2)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k, v in r.items():
            assert v is not None or k == "train/grad_norm", k


def test_a_bf16_base_keeps_fp32_adapters(tmp_path, arith_model):
    seen = {}
    _run(tmp_path, "b", on_model=lambda m: seen.update(m=m), base_dtype="bf16", steps=2)
    dtypes = {("lora_" in n, p.dtype) for n, p in seen["m"].named_parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


@pytest.mark.parametrize("extra,words", [
    ({"async_engine": True}, ["--async-engine"]),
    ({"base_dtype": "bf16", "lora_rank": 0}, ["base_dtype=bf16", "--lora-rank"]),
    ({"lora_targets": "no_such_proj"}, ["lora_targets='no_such_proj'"]),
])
def test_lora_settings_that_cannot_work_are_refused(extra, words, tmp_path, arith_model):
    with pytest.raises(ParityError) as e:
        _run(tmp_path, "x", steps=1, **extra)
    for w in words:
        assert w in str(e.value)


def test_audit_of_a_base_plus_an_adapter(tmp_path, arith_model):
    """`parity audit --model BASE --adapter DIR` audits the adapted model: a LoRA checkpoint's
    adapters, audited with an fp32 engine, agree with the trainer to kernel noise, and with a
    bf16 engine show the bf16 gap."""
    from parity.audit.command import audit
    from parity.config import AuditSettings
    out, _ = _run(tmp_path, "a", steps=3)
    adapter = out / "checkpoints" / "step-3"
    res = {}
    for engine in ("fp32", "bf16"):
        res[engine] = audit(AuditSettings(model="arith-xs", adapter=str(adapter), task="arith",
                                          engine_dtype=engine, samples=32, group=4,
                                          progress=False), tmp_path / f"audit-{engine}")
    assert res["fp32"]["metrics"]["mismatch/beta_abs_mean"] < 1e-4
    assert res["bf16"]["metrics"]["mismatch/beta_abs_mean"] > 1e-3
