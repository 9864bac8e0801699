"""Dropout stays out of every forward that enters a ratio: on a model with dropout (GPT-2's
default 0.1), an fp32 engine against an fp32 trainer must see no gap and clip nothing at the
first update, where the policy has not moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.cli import main

pytestmark = pytest.mark.e2e

RUN = ["--prompts-per-step", "2", "--samples-per-prompt", "8", "--max-new-tokens", "16",
       "--steps", "1", "--threads", "1", "--no-progress", "--report-to", "none",
       "--recipe", "fp32", "--eps-low", "0.05", "--eps-high", "0.05"]


@pytest.fixture(scope="module")
def gpt2(gpt2_model) -> Path:
    path = gpt2_model
    assert json.loads((path / "config.json").read_text())["resid_pdrop"] == 0.1
    return path


def first_step(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_no_gap_and_no_clip_at_the_first_update_with_dropout_in_the_model(tmp_path, gpt2):
    assert main(["train", "--model", str(gpt2), *RUN, "--out", str(tmp_path / "run")]) == 0
    m = first_step(tmp_path / "run")
    print(f"\ndropout off: |alpha| {m['mismatch/alpha_abs_mean']:.3g}, clip/frac {m['clip/frac']}")
    assert m["clip/frac"] == 0.0
    assert m["mismatch/alpha_abs_mean"] < 1e-5     # fp32 engine and trainer, θ = θ_old
    assert m["mismatch/beta_abs_mean"] == 0.0


def test_keep_dropout_brings_the_noise_back(tmp_path, gpt2):
    assert main(["train", "--model", str(gpt2), *RUN, "--keep-dropout",
                 "--out", str(tmp_path / "run")]) == 0
    m = first_step(tmp_path / "run")
    print(f"\n--keep-dropout: |alpha| {m['mismatch/alpha_abs_mean']:.3g}, "
          f"clip/frac {m['clip/frac']:.3g}")
    assert m["mismatch/alpha_abs_mean"] > 1e-2 and m["clip/frac"] > 0.0


def test_trl_trainer_measures_without_dropout_whatever_grpo_config_says(tmp_path, gpt2):
    """TRL keeps dropout here (disable_dropout=False); with it, |β| per token is dominated by
    dropout noise (about 0.1 on this model), without it it is the bf16 gap (about 0.003)."""
    pytest.importorskip("trl")
    import sys

    import torch
    sys.path.insert(0, str(Path(__file__).parent))
    from test_trl import _trainer
    t = _trainer(gpt2, tmp_path, recipe="bf16-engine", steps=1, disable_dropout=False)
    t.train()
    step = [h for h in t.state.log_history if "clip/frac" in h][0]
    assert all(m.p == 0.0 for m in t.model.modules() if isinstance(m, torch.nn.Dropout))
    print(f"\nTRL bf16-engine, GRPOConfig(disable_dropout=False): |beta| "
          f"{step['mismatch/beta_abs_mean']:.3g}")
    assert step["mismatch/beta_abs_mean"] < 0.02, step["mismatch/beta_abs_mean"]
