"""The `device` setting on a machine without a GPU: the CPU path is unchanged, nothing is made
on a device nobody asked for, and a CUDA device this machine lacks is one clear line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_user_error, run_main
from parity import devices
from parity.config import AuditSettings, make_config
from parity.errors import ParityError
from parity.trainer import train

REFERENCE = Path(__file__).parent / "data" / "device_cpu"
# Runs recorded with parity's default device (3 steps, 4 prompts x 4 completions, 12 tokens,
# seed 0, 1 thread), one set per testbed build: the test-size models build to other weights on
# a CPU with AMX than on one without (CONTRIBUTING.md, "Figures depend on the CPU"). Each set's
# models.json holds the sha256 of the weights it was recorded on and when it was recorded.
# scripts/record_device_cpu.py records the set for another build; a change that moves a figure
# on purpose (a metric's new formulation) records the sets again.
CASES = {
    "bf16-engine-2x2": dict(model="text-xs", recipe="bf16-engine", minibatches=2, epochs=2),
    "fp16": dict(model="text-xs", recipe="fp16"),
    "tis": dict(model="arith-xs", task="arith", recipe="tis"),
    "bf16-shadow-micro": dict(model="text-xs", recipe="bf16-shadow", micro_batch=4,
                              rollout_batch=2),
    "ppo-value": dict(model="text-xs", recipe="bf16-engine", objective="ppo-value"),
    "online-dpo": dict(model="text-xs", recipe="bf16-engine", objective="online-dpo"),
    "async": dict(model="text-xs", recipe="bf16-engine", async_engine=True, max_staleness=1),
}
TIMING = ("time/", "throughput/", "async/wait_s")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _settings(tmp_path: Path, name: str, **kw) -> dict:
    return {"out": str(tmp_path / name), "progress": False, "steps": 3, "prompts_per_step": 4,
            "samples_per_prompt": 4, "max_new_tokens": 12, "threads": 1, "seed": 0, "lr": 1e-3,
            **CASES[name], **kw}


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)}
            for x in path.read_text().splitlines()]


def _reference_for(cache: Path) -> Path:
    """The recorded set whose testbed build is the one this machine made."""
    digests = {m: hashlib.sha256((cache / "models" / m / "model.safetensors").read_bytes())
               .hexdigest() for m in ("text-xs", "arith-xs")}
    for d in sorted(REFERENCE.iterdir()):
        recorded = json.loads((d / "models.json").read_text())
        if all(recorded[m] == digest for m, digest in digests.items()):
            return d
    pytest.fail(f"no run in tests/data/device_cpu was recorded on this machine's testbed build "
                f"(text-xs {digests['text-xs'][:12]}, arith-xs {digests['arith-xs'][:12]}): "
                f"on a commit known good, python scripts/record_device_cpu.py records one")


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(CASES))
def test_device_cpu_gives_the_recorded_metrics_bit_for_bit(name, tmp_path, cache, text_model,
                                                           arith_model):
    reference = _reference_for(cache)
    out = train(make_config(_settings(tmp_path, name, device="cpu")))
    got, want = _rows(out / "metrics.jsonl"), _rows(reference / f"{name}.jsonl")
    assert got == want  # every figure, to the last bit


def _meta_by_default(model: torch.nn.Module) -> None:
    torch.set_default_device("meta")


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(CASES))
def test_a_run_makes_no_tensor_on_the_default_device(name, tmp_path, text_model, arith_model):
    """On a GPU, a tensor made without a device lands on the CPU beside CUDA tensors. Here the
    run computes on the CPU and the default device is `meta` once the model is loaded: every
    tensor the run makes without saying where fails the same way (meta has no data)."""
    try:
        train(make_config(_settings(tmp_path, name, steps=2, dump_rollouts=1, kl_exact_rows=2,
                                    device="cpu")), on_model=_meta_by_default)
    finally:
        torch.set_default_device(None)


@pytest.mark.e2e
def test_audit_and_fp16_check_make_no_tensor_on_the_default_device(tmp_path, text_model,
                                                                    monkeypatch):
    import parity.audit.command as audit
    import parity.fp16_check as fp16_check
    for mod in (audit, fp16_check):
        def load_then_meta(*a, _load=mod.load_policy, **k):
            loaded = _load(*a, **k)
            torch.set_default_device("meta")
            return loaded
        monkeypatch.setattr(mod, "load_policy", load_then_meta)
    try:
        res = audit.audit(AuditSettings(model="text-xs", task="neg-length", samples=16, group=4,
                                        max_new_tokens=8, kl_exact_rows=2, progress=False,
                                        device="cpu"), tmp_path / "audit")
        assert res["device"].startswith("cpu") and res["tokens"] > 0
        torch.set_default_device(None)
        res = fp16_check.check("text-xs", max_prompts=2, out=tmp_path / "fp16", progress=False,
                               device="cpu")
        assert res["device"].startswith("cpu")
    finally:
        torch.set_default_device(None)


def test_device_setting_is_checked_with_the_other_fields():
    with pytest.raises(ParityError, match=r"device='gpu' must be auto, cpu, cuda or cuda:N"):
        make_config({"device": "gpu", "model": "text-xs"})
    for ok in ("auto", "cpu", "cuda", "cuda:3"):
        assert make_config({"device": ok, "model": "text-xs"}).device == ok


@no_cuda
def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused():
    assert devices.resolve("auto") == torch.device("cpu")
    assert devices.resolve("cpu") == torch.device("cpu")
    for setting in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ParityError, match=f"device={setting}: torch sees no CUDA device"):
            devices.resolve(setting)


@pytest.mark.e2e
@no_cuda
@pytest.mark.parametrize("command", [
    ["train", "--model", "text-xs", "--steps", "1"],
    ["audit", "--model", "text-xs", "--task", "neg-length"],
    ["fp16-check", "--model", "text-xs"],
    ["sweep", "--recipes", "fp32", "--out", "{tmp}/sweep"],
    ["reproduce", "--quick", "--out", "{tmp}/reproduce"],
])
def test_cuda_on_a_machine_without_cuda_is_one_line_and_exit_2(command, tmp_path, monkeypatch):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command]
    monkeypatch.chdir(tmp_path)
    p = run_main(*argv, "--device", "cuda")
    assert_user_error(p, "device=cuda", "no CUDA device")
    assert len(p.stderr.strip().splitlines()) == 1, f"more than the error was printed: {p.stderr}"
    assert not any(tmp_path.iterdir()), "nothing is written before the device is checked"


@pytest.mark.e2e
def test_a_run_may_resume_on_another_device(tmp_path, text_model):
    """A run started with `--device auto` continues with `--device cpu` (a GPU run on a CPU, or
    the other way round), from its checkpoint, to the same figures as one run."""
    from parity.cli import main
    run = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
           "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--lr", "1e-3",
           "--save-every", "1"]
    assert main(["train", *run, "--steps", "2", "--out", str(tmp_path / "a")]) == 0
    assert main(["train", "--resume", str(tmp_path / "a"), "--steps", "4", "--device",
                 "cpu"]) == 0
    assert main(["train", *run, "--steps", "4", "--out", str(tmp_path / "b")]) == 0
    assert _rows(tmp_path / "a" / "metrics.jsonl") == _rows(tmp_path / "b" / "metrics.jsonl")
