"""End to end: `parity train` on testbed models, its run directory, and the must-show runs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from parity.config import load_yaml, make_config
from parity.trainer import train

pytestmark = pytest.mark.e2e

# The metric names docs/design.md makes a contract (every run writes these).
CONTRACT = ["step", "reward/mean", "reward/std", "completion/len_mean", "clip/frac",
            "clip/phantom_frac", "clip/hidden_frac", "clip/alpha_frac",
            "mismatch/alpha_abs_mean", "mismatch/beta_mean", "mismatch/beta_abs_mean",
            "mismatch/beta_std", "mismatch/beta_adv_corr", "mismatch/kl_k1", "mismatch/kl_k3",
            "mismatch/prob_diff_abs_mean",
            "mismatch/prob_diff_max", "mismatch/prob_diff_min", "sync/changed_frac",
            "loss/scale", "train/skipped_updates", "time/rollout_s", "time/train_s",
            "time/step_s", "throughput/tokens_per_s"]


def run(tmp_path, **kw):
    explicit = {"out": str(tmp_path / "run"), "progress": False, **kw}
    cfg = make_config(explicit)
    out = train(cfg)
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_mismatch_metrics_do_not_count_the_policys_own_move(tmp_path, text_model):
    """fp32 engine and fp32 trainer: no mismatch beyond kernel noise. With two minibatches the
    second is scored after an update at a large learning rate; its ℓ_π − ℓ_μ is the policy's
    move, and the mismatch figures must not count it."""
    _, rows = run(tmp_path, model="text-xs", recipe="fp32", steps=2, lr=3e-3,
                  prompts_per_step=4, samples_per_prompt=4, minibatches=2, epochs=2,
                  kl_exact_rows=4, max_new_tokens=12)
    for r in rows:
        assert r["clip/frac"] > 0  # the policy moved far enough to be clipped
        assert abs(r["mismatch/kl_k1"]) < 1e-5 and r["mismatch/kl_k3"] < 1e-6
        assert r["mismatch/kl_exact"] < 1e-6
        assert abs(r["mismatch/seq_log_ratio_mean"]) < 1e-4


def test_run_directory_contract(tmp_path, text_model):
    out, rows = run(tmp_path, model="text-xs", recipe="bf16-engine", steps=3, lr=1e-3,
                    prompts_per_step=4, samples_per_prompt=4, minibatches=2, epochs=2,
                    save_every=2)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(CONTRACT) <= set(r), set(CONTRACT) - set(r)
        assert all(isinstance(v, (int, float)) for v in r.values())
    assert rows[0]["sync/changed_frac"] == 0.0  # the engine starts as a cast of the master
    assert rows[1]["sync/changed_frac"] > 0.0   # lr 1e-3 moves bf16 weights
    assert rows[0]["mismatch/kl_k1"] != 0.0     # bf16 engine vs fp32 trainer disagree
    assert make_config(load_yaml(out / "config.yaml")).minibatches == 2
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-2", "step-3"]
    final = out / "checkpoints" / "step-3"
    model = AutoModelForCausalLM.from_pretrained(final)  # an ordinary HF model directory
    start = load_file(str(text_model / "model.safetensors"))
    moved = load_file(str(final / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in moved.values())
    assert any(not torch.equal(start[k], moved[k]) for k in start)
    assert model.config.vocab_size > 0
    state = json.loads((final / "state.json").read_text())
    assert state["step"] == 3
    torch.load(final / "train.pt", weights_only=True)
    torch.load(final / "rng.pt", weights_only=True)


def test_rollout_dump_matches_metrics(tmp_path, text_model):
    """--dump-rollouts 2: the per-token parquet (docs/design.md) on steps 2 and 4, one row per
    token per update, consistent with the step's metrics and with the decomposition."""
    import pyarrow.parquet as pq

    from parity.diagnostics import DUMP_COLUMNS
    out, rows = run(tmp_path, model="text-xs", recipe="bf16-engine", steps=4, lr=1e-3,
                    prompts_per_step=4, samples_per_prompt=4, minibatches=2, epochs=2,
                    eps_low=0.005, eps_high=0.005, dump_rollouts=2)
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step-2.parquet",
                                                                     "step-4.parquet"]
    t = pq.read_table(out / "rollouts" / "step-2.parquet").to_pandas()
    assert list(t.columns) == list(DUMP_COLUMNS)
    assert sorted(t["update"].unique()) == [0, 1, 2, 3]        # 2 epochs x 2 minibatches
    m = rows[1]
    assert len(t) == 2 * m["completion/len_mean"] * 16          # every token, in both epochs
    assert t["clipped"].mean() == pytest.approx(m["clip/frac"])
    assert t["phantom_clipped"].mean() == pytest.approx(m["clip/phantom_frac"])
    assert t["hidden"].mean() == pytest.approx(m["clip/hidden_frac"])
    beta = t["trainer_logprob"] - t["shadow_logprob"]
    assert beta.mean() == pytest.approx(m["mismatch/beta_mean"], abs=1e-6)
    # Recompute the attribution from the dumped columns (docs/design.md's predicates, by hand).
    import math
    hi, lo = math.log(1 + 0.005), math.log(1 - 0.005)
    x = t["trainer_logprob"] - t["engine_logprob"]
    a = t["shadow_logprob"] - t["engine_logprob"]
    c = ((t["advantage"] > 0) & (x > hi)) | ((t["advantage"] < 0) & (x < lo))
    ca = ((t["advantage"] > 0) & (a > hi)) | ((t["advantage"] < 0) & (a < lo))
    assert (c == t["clipped"]).all() and ((c & ~ca) == t["phantom_clipped"]).all()
    assert m["clip/phantom_frac"] > 0   # at eps 0.005 a bf16 engine clips by numerics alone
    assert m["mismatch/kl_exact_positions"] > 0 and m["mismatch/kl_exact"] > 0


def test_fp16_recipe_reports_loss_scale(tmp_path, text_model):
    _, rows = run(tmp_path, model="text-xs", recipe="fp16", steps=2, prompts_per_step=2,
                  samples_per_prompt=4, max_new_tokens=8)
    assert rows[0]["loss/scale"] in (2.0**16, 2.0**15)  # GradScaler's initial scale (or 1 backoff)
    assert all(r["train/skipped_updates"] <= 1 for r in rows)


def test_same_seed_same_metrics(tmp_path, text_model):
    keys = ["reward/mean", "completion/len_mean", "clip/frac", "mismatch/kl_k1"]
    a = run(tmp_path / "a", model="text-xs", steps=2, prompts_per_step=2, max_new_tokens=8)[1]
    b = run(tmp_path / "b", model="text-xs", steps=2, prompts_per_step=2, max_new_tokens=8)[1]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def test_neg_length_small(tmp_path, text_model):
    """CI-size version of the sanity check: the test-size text LM learns to stop early."""
    _, rows = run(tmp_path, model="text-xs", recipe="fp32", steps=20, lr=3e-3,
                  max_new_tokens=16)
    first = sum(r["completion/len_mean"] for r in rows[:3]) / 3
    last = sum(r["completion/len_mean"] for r in rows[-3:]) / 3
    assert last < 0.5 * first, (first, last)


def test_arith_small(tmp_path, arith_model):
    """CI-size version of the arith run: the filtered start is partial, and reward rises."""
    out, rows = run(tmp_path, model="arith-xs", task="arith", recipe="fp16", steps=80,
                    prompts_per_step=16)
    info = json.loads((out / "task.json").read_text())
    assert info["kept"] > 0 and 0.2 <= info["kept_solve_rate"] <= 0.8
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first + 0.1, (first, last)


def test_module_entry_point_with_a_model_directory(tmp_path, text_model):
    """`python -m parity` works, and --model takes any local HF causal LM directory."""
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--model", str(text_model),
                        "--steps", "1", "--prompts-per-step", "1", "--samples-per-prompt", "2",
                        "--max-new-tokens", "4", "--out", str(tmp_path / "r"), "--no-progress"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "reward/mean" in p.stdout


@pytest.mark.slow
def test_must_show_neg_length_fp32(tmp_path, cache):
    """The testbed's first check of a working setup: mean completion length <= 1.5 tokens
    within 30 steps."""
    _, rows = run(tmp_path, task="neg-length", recipe="fp32")
    assert len(rows) <= 30
    assert min(r["completion/len_mean"] for r in rows) <= 1.5


@pytest.mark.slow
def test_must_show_arith_fp16(tmp_path, cache):
    """The testbed's second check: arith training reward from the filtered start to >= 0.9."""
    _, rows = run(tmp_path, task="arith", recipe="fp16")
    assert rows[0]["reward/mean"] < 0.8
    best5 = max(sum(r["reward/mean"] for r in rows[i:i + 5]) / 5 for i in range(len(rows) - 4))
    assert best5 >= 0.9


def test_default_run_directories_never_collide(tmp_path, text_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(model="text-xs", steps=1, prompts_per_step=1, samples_per_prompt=2,
              max_new_tokens=4, progress=False)
    a = train(make_config(kw))
    b = train(make_config(kw))
    assert a.resolve() == (tmp_path / "runs" / "neg-length-bf16-engine-s0").resolve()
    assert b.resolve() == (tmp_path / "runs" / "neg-length-bf16-engine-s0-2").resolve()
    assert (a / "metrics.jsonl").is_file() and (b / "metrics.jsonl").is_file()
