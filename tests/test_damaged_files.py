"""Binary files read through libraries (safetensors weights and adapters, torch.save state,
GGUF) go through one checked reader: a file cut short or damaged is one line naming it, never
the library's traceback (docs/errors.md, "Damaged binary files")."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import TINY_RUN, assert_user_error, cli
from parity import files
from parity.cli import main
from parity.errors import ParityError
from parity.models import lora
from parity.models.loading import load_policy

RUN = TINY_RUN


@pytest.fixture
def whole(tmp_path) -> Path:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
               "b": torch.ones(5, dtype=torch.bfloat16)}, str(path))
    return path


@pytest.mark.parametrize("cut,words", [
    (4, "shorter than the 8-byte header length"),
    (20, "cut short"),          # inside the header
    (-3, "cut short"),          # inside the last tensor's bytes
])
def test_a_cut_safetensors_file_is_one_line_naming_it(whole, cut, words):
    data = whole.read_bytes()
    whole.write_bytes(data[:cut])
    with pytest.raises(ParityError, match=words) as e:
        files.read_safetensors(whole, "weights file")
    assert str(whole) in str(e.value)


def test_a_safetensors_header_that_lies_is_one_line(whole):
    data = bytearray(whole.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["a"]["shape"] = [4, 4]  # 64 bytes claimed for 48
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    whole.write_bytes(bytes(data[:8]) + text[:n] + bytes(data[8 + n:]))
    with pytest.raises(ParityError, match="tensor 'a'"):
        files.check_safetensors(whole, "weights file")


def test_a_whole_safetensors_file_reads_as_written(whole):
    t = files.read_safetensors(whole, "weights file")
    assert torch.equal(t["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert t["b"].dtype == torch.bfloat16


@pytest.mark.e2e
def test_a_cut_adapter_is_one_line(tmp_path, text_model):
    model, _ = load_policy(text_model)
    adapted = lora.wrap(model, 4, None, "all-linear", True, torch.float32)
    adapted.save_pretrained(tmp_path / "adapter")
    f = tmp_path / "adapter" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    fresh, _ = load_policy(text_model)
    with pytest.raises(ParityError, match="adapter file .*adapter_model.safetensors is not a "
                                          "whole safetensors file"):
        lora.from_adapter(fresh, str(tmp_path / "adapter"), True)


@pytest.mark.e2e
def test_a_model_with_cut_weights_is_refused_before_any_work(tmp_path, text_model):
    model = tmp_path / "model"
    shutil.copytree(text_model, model)
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    p = cli("train", *RUN[2:], "--model", str(model), "--steps", "1", "--out",
            str(tmp_path / "run"))
    assert_user_error(p, str(w), "not a whole safetensors file")
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_damaged_checkpoint_that_matches_its_manifest_is_one_line(tmp_path, text_model):
    """A checkpoint written damaged (its manifest taken from the damaged bytes) passes the
    checksum; its reader still names it."""
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--save-every", "1", "--out", str(run)]) == 0
    ck = run / "checkpoints" / "step-2"
    train_pt = ck / "train.pt"
    train_pt.write_bytes(train_pt.read_bytes()[:1000])
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["train.pt"] = {"sha256": hashlib.sha256(train_pt.read_bytes()).hexdigest(),
                                     "bytes": train_pt.stat().st_size}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    p = cli("train", "--resume", str(run), "--steps", "3", "--no-progress")
    assert_user_error(p, "checkpoint file", str(train_pt), "cannot be read")


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(ParityError, match=r"m.gguf: not a GGUF file \(it starts b'PK"):
        files.check_gguf(bad, "GGUF file")
    bad.write_bytes(b"GGUF\x07\0\0\0" + b"\0" * 40)
    with pytest.raises(ParityError, match="declares GGUF version 7"):
        files.check_gguf(bad, "GGUF file")
