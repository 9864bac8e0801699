"""The `device` setting on a machine without a GPU: the CPU path is unchanged, nothing is made
on a device nobody asked for, and a CUDA device this machine lacks is one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_user_error, run_main
from parity import devices
from parity.config import AuditSettings, make_config
from parity.errors import ParityError
from parity.trainer import train
from test_metric_names import _unregistered

# The runs every case below makes: the objectives, corrections, fp16, micro-batches with a
# bounded engine batch and the asynchronous engine (3 steps, 4 prompts x 4 completions, 12
# tokens, seed 0, 1 thread), with the exact KL's rows and a rollout dump so that their code runs
# too.
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
            "dump_rollouts": 1, "kl_exact_rows": 2, **CASES[name], **kw}


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)}
            for x in path.read_text().splitlines()]


def _meta_by_default(model: torch.nn.Module) -> None:
    torch.set_default_device("meta")


@pytest.mark.e2e
@no_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_device_cpu_is_the_default_device_bit_for_bit_with_no_tensor_left_undeviced(
        name, tmp_path, text_model, arith_model):
    """`--device cpu` computes what the default device (`auto`, the CPU here) computes, to the
    last bit of every figure: the reference is the same run made in this process, so the check
    holds on any CPU (the testbed builds to other weights, and bf16 kernels round otherwise, on
    each kind: CONTRIBUTING.md). The second run also has torch's default device set to `meta`
    once the model is loaded: on a GPU a tensor made without a device lands on the CPU beside
    CUDA tensors and the run fails, and here every such tensor fails the same way (meta has no
    data). A change that moves a figure on purpose is compared before and after on one machine
    (scripts/same_metrics.py, CONTRIBUTING.md)."""
    want = train(make_config(_settings(tmp_path / "auto", name, device="auto")))
    try:
        got = train(make_config(_settings(tmp_path / "cpu", name, device="cpu")),
                    on_model=_meta_by_default)
    finally:
        torch.set_default_device(None)
    got, want = _rows(got / "metrics.jsonl"), _rows(want / "metrics.jsonl")
    assert len(got) == 3 and got == want  # every figure, to the last bit
    assert not any(_unregistered(row) for row in got)  # parity/metric_names.py names them all


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
