"""On a CUDA device: every recipe trains, fp16 overflows are skipped, the audit and fp16-check
run, a resumed run continues as one, two ranks train on NCCL. Skipped where torch sees no CUDA
(`pytest -m gpu` on a GPU machine runs exactly these)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.config import RECIPES, AuditSettings, make_config
from parity.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

SMALL = dict(model="text-xs", steps=2, prompts_per_step=4, samples_per_prompt=4,
             max_new_tokens=12, lr=1e-3, progress=False)


def _run(tmp_path: Path, name: str, on_model=None, **kw) -> tuple[Path, list[dict]]:
    out = train(make_config({**SMALL, "out": str(tmp_path / name), **kw}), on_model)
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _numbers_finite(rows: list[dict]) -> None:
    """Every number finite. Missing (null) only the gradient norm, or on a step whose update was
    skipped: what was measured from its overflowed forward is missing, never inf or nan."""
    for r in rows:
        for k, v in r.items():
            if v is None:
                assert k == "train/grad_norm" or r.get("train/skipped_this_step"), (k, r["step"])
            else:
                assert math.isfinite(v), (k, v)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_trains_on_cuda(recipe, tmp_path, text_model):
    seen = {}

    def where(model):
        seen["device"] = next(model.parameters()).device
    out, rows = _run(tmp_path, recipe, on_model=where, recipe=recipe, device="cuda")
    assert seen["device"].type == "cuda"
    assert [r["step"] for r in rows] == [1, 2]
    _numbers_finite(rows)
    assert (out / "checkpoints" / "step-2" / "model.safetensors").is_file()


def test_first_step_on_cuda_samples_what_the_cpu_samples(tmp_path, text_model):
    """One seed draws the same random numbers on both devices (the sampling generator stays on
    the CPU): with fp32 on both sides the completions differ only where kernel noise moves a
    token across a draw's boundary."""
    import pyarrow.parquet as pq
    kw = dict(recipe="fp32", steps=1, dump_rollouts=1)
    runs = {d: _run(tmp_path, d, device=d, **kw)[0] for d in ("cpu", "cuda")}
    seqs = {}
    for d, out in runs.items():
        t = pq.read_table(out / "rollouts" / "step-1.parquet").to_pandas()
        seqs[d] = t.groupby("sample_id")["token_id"].apply(tuple).to_dict()
    same = sum(seqs["cpu"][k] == seqs["cuda"].get(k) for k in seqs["cpu"]) / len(seqs["cpu"])
    print(f"completions identical on cpu and cuda: {same:.0%}")
    assert same >= 0.75


def test_fp16_overflow_is_skipped_on_cuda(tmp_path, text_model):
    calls = {"n": 0}

    def inject(model):
        def blow_up(module, args, output):
            if torch.is_grad_enabled():
                calls["n"] += 1
                if calls["n"] in (3, 4):
                    return output * 1e6
            return output
        model.get_output_embeddings().register_forward_hook(blow_up)
    out, rows = _run(tmp_path, "fp16", on_model=inject, recipe="fp16", steps=5,
                     prompts_per_step=2, max_new_tokens=8, device="cuda")
    assert [r["train/skipped_this_step"] for r in rows] == [0, 0, 1, 1, 0]
    assert rows[3]["loss/scale"] < rows[1]["loss/scale"]
    _numbers_finite(rows)


def test_audit_and_fp16_check_on_cuda(tmp_path, text_model):
    from parity import fp16_check
    from parity.audit.command import audit
    for engine in ("bf16", "fp16"):
        res = audit(AuditSettings(model="text-xs", task="neg-length", samples=32, group=4,
                                  engine_dtype=engine, progress=False, device="cuda"),
                    tmp_path / f"audit-{engine}")
        assert res["device"].startswith("cuda")
        assert 0 < res["metrics"]["mismatch/beta_abs_mean"] < 1
    res = fp16_check.check("text-xs", max_prompts=2, out=tmp_path / "fp16", progress=False,
                           device="cuda")
    assert res["device"].startswith("cuda") and res["verdict"]["inference"] == "OK"


def test_resume_on_cuda_continues_as_one_run(tmp_path, text_model):
    from parity.cli import main
    run = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
           "--max-new-tokens", "8", "--no-progress", "--lr", "1e-3", "--save-every", "1",
           "--device", "cuda"]
    assert main(["train", *run, "--steps", "2", "--out", str(tmp_path / "a")]) == 0
    assert main(["train", "--resume", str(tmp_path / "a"), "--steps", "4"]) == 0
    assert main(["train", *run, "--steps", "4", "--out", str(tmp_path / "b")]) == 0
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("a", "b")]
    for ra, rb in zip(*rows):
        for k, v in ra.items():
            if not k.startswith(("time/", "throughput/")) and isinstance(v, float):
                assert v == pytest.approx(rb[k], rel=1e-4, abs=1e-6), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_train_on_nccl(tmp_path, text_model, cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(port), "-m", "parity", "train", "--model", "text-xs",
         "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
         "--max-new-tokens", "8", "--no-progress", "--device", "auto",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env={**os.environ, "PARITY_CACHE": str(cache)},
        timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2


def test_logprobs_without_gradient_in_chunks_on_cuda():
    """On a GPU the chunks are larger (the caching allocator reuses memory) but the log-probs
    are still the whole tensor's, within float32 rounding, with a repetition penalty's rows."""
    from parity.logprobs import Sampling, logprobs_from_logits, scoring, seen_before
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 700, 151_936
    assert scoring.row_chunk(V, dev) < T  # more than one chunk a row
    logits = (torch.randn(B, T, V, generator=g) * 3).bfloat16().to(dev)
    tokens = torch.randint(0, V, (B, T), generator=g).to(dev)
    prompt = torch.randint(0, V, (B, 5), generator=g).to(dev)
    s = Sampling(0.9, top_k=50, repetition_penalty=1.3)
    seen = seen_before(prompt, torch.ones_like(prompt), tokens, torch.ones(B, T, device=dev), V)
    whole = scoring._logprobs(logits, tokens, s, True, seen)
    with torch.no_grad():
        chunked = logprobs_from_logits(logits, tokens, s, seen=seen)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
