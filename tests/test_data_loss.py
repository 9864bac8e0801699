"""Fault injection for the cases that could lose or corrupt a run: each refused command leaves the
run directory byte for byte as it was, an unreadable checkpoint is "not valid" (never a crash),
and no non-finite weight is ever saved."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_user_error, run_main
from parity.cli import main
from parity.errors import ParityError
from parity.models.loading import load_policy
from parity.models.precision import LossScaler
from parity.runs import checkpoints

RUN = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
       "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--report-to", "none"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (and every directory) with its content's hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


# Refusals and resumes through parity's entry point in this process (cli_helpers.run_main).
cli = run_main


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, text_model) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *RUN, "--steps", "3", "--save-every", "1", "--out", str(run)]) == 0
    return run


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


@pytest.mark.e2e
def test_resume_with_checkpoints_path_a_file_is_refused_and_changes_nothing(tmp_path,
                                                                            finished_run):
    run = copy_run(finished_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a directory\n")
    before = snapshot(run)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    p = cli("train", "--resume", str(run), "--steps", "5", "--no-progress")
    assert_user_error(p, "checkpoints is not a directory", "Nothing was changed")
    assert snapshot(run) == before


@pytest.mark.e2e
def test_checkpoints_path_that_stops_being_a_directory_mid_run_is_one_line(tmp_path,
                                                                           text_model):
    run = tmp_path / "run"
    # After the first checkpoint is written, replace the checkpoints directory by a file: the
    # next save must fail with one line, and every step's metrics so far stay on disk.
    code = f"""
import shutil, sys
from pathlib import Path
from parity.runs import checkpoints
from parity.cli import main
real = checkpoints.prune
def prune(run, keep):
    real(run, keep)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("in the way")
checkpoints.prune = prune
sys.exit(main(["train", *{RUN!r}, "--steps", "3", "--save-every", "1", "--out", {str(run)!r}]))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert_user_error(p, "cannot write the checkpoint of step 2", "Not a directory")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def _rewrite_in_manifest(ckpt: Path, name: str, text: str) -> None:
    """Change a checkpoint file and its manifest entry together, so only the content is bad."""
    (ckpt / name).write_text(text)
    man = json.loads((ckpt / checkpoints.MANIFEST).read_text())
    data = (ckpt / name).read_bytes()
    man["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / checkpoints.MANIFEST).write_text(json.dumps(man))


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["manifest-without-files", "manifest-not-a-mapping",
                                    "state-without-prompts", "state-not-json"])
def test_unreadable_checkpoint_is_not_valid_and_resume_falls_back(tmp_path, finished_run,
                                                                  damage, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    newest = run / "checkpoints" / "step-3"
    if damage == "manifest-without-files":
        (newest / checkpoints.MANIFEST).write_text(json.dumps({"step": 3}))
    elif damage == "manifest-not-a-mapping":
        (newest / checkpoints.MANIFEST).write_text("[1, 2]")
    elif damage == "state-without-prompts":
        state = json.loads((newest / "state.json").read_text())
        del state["prompts"]
        _rewrite_in_manifest(newest, "state.json", json.dumps(state))
    else:
        _rewrite_in_manifest(newest, "state.json", "{not json")
    assert checkpoints.verify(newest) is not None
    restored = checkpoints.latest_valid(run)
    assert restored is not None and restored.step == 2
    assert "step-3 is corrupt" in capsys.readouterr().err


@pytest.mark.e2e
def test_no_checkpoint_keeps_the_logged_steps_beside_the_restarted_run(tmp_path, finished_run):
    run = copy_run(finished_run, tmp_path / "run")
    logged = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints")
    p = cli("train", "--resume", str(run), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert (run / "metrics-before-restart.jsonl").read_text() == logged
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.e2e
def test_a_checkpoint_with_a_non_finite_weight_is_never_written(tmp_path, text_model):
    model, tok = load_policy(text_model)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ParityError, match="is not finite; the checkpoint is not written"):
        checkpoints.save(tmp_path, 1, model, tok, model, 0, opt, {}, {}, torch.Generator(),
                         None, 3)
    assert checkpoints.steps_on_disk(tmp_path) == []
    assert not any((tmp_path / "checkpoints").glob(".tmp-step-*"))


def test_an_update_that_overflows_a_parameter_stops_the_run():
    w = torch.nn.Parameter(torch.tensor([1e30, 1.0]))
    opt = torch.optim.SGD([w], lr=1e30)
    scaler = LossScaler("fp32", torch.device("cpu"))
    scaler.backward((w * 1e10).sum())  # finite gradient, an update beyond float32
    with pytest.raises(ParityError, match="non-finite although the gradient was finite"):
        scaler.step(opt, [w], max_grad_norm=0.0)


def test_a_non_finite_gradient_is_skipped_not_applied():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = LossScaler("fp32", torch.device("cpu"))
    scaler.backward((w * float("inf")).sum())
    applied, _ = scaler.step(opt, [w], max_grad_norm=1.0)
    assert not applied and scaler.skipped == 1
    assert w.tolist() == [1.0, 2.0]


def _edited_copy(text_model: Path, dest: Path, **changes) -> Path:
    shutil.copytree(text_model, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update({k: (v(cfg[k]) if callable(v) else v) for k, v in changes.items()})
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.e2e
@pytest.mark.parametrize("change,words", [
    (dict(num_hidden_layers=lambda n: n + 1), "are not in the files"),
    (dict(num_hidden_layers=lambda n: n - 1), "are not in config.json's model"),
    (dict(vocab_size=lambda n: n + 16), "differ in shape"),
])
def test_config_that_disagrees_with_the_weights_is_refused(tmp_path, text_model, change, words):
    model = _edited_copy(text_model, tmp_path / "m", **change)
    with pytest.raises(ParityError, match="config.json does not match the weights") as e:
        load_policy(model)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.e2e
def test_config_mismatch_ends_train_in_one_line_before_any_work(tmp_path, text_model):
    model = _edited_copy(text_model, tmp_path / "m", vocab_size=lambda n: n + 16)
    p = cli("train", "--model", str(model), "--steps", "1", "--no-progress",
            "--out", str(tmp_path / "run"))
    assert_user_error(p, "config.json does not match the weights", "lm_head.weight")
    assert "Loading weights" not in p.stderr and "report" not in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_an_encoder_only_model_is_refused_before_any_work(tmp_path, text_model):
    from transformers import BertConfig, BertForMaskedLM
    d = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(d)
    for f in text_model.glob("tokenizer*"):
        shutil.copy(f, d)
    p = cli("train", "--model", str(d), "--steps", "1", "--no-progress",
            "--out", str(tmp_path / "run"))
    assert_user_error(p, "is not a causal LM", "bert")
    assert not (tmp_path / "run").exists()
