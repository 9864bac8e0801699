"""The asynchronous engine: a real engine process, bounded staleness, exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import assert_user_error, run_main
from parity.config import make_config
from parity.trainer import train

pytestmark = pytest.mark.e2e

BASE = dict(task="neg-length", model="text-xs", max_new_tokens=12, prompts_per_step=4,
            samples_per_prompt=4, progress=False, report_to="none")


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def same(a: list[dict], b: list[dict], tol: float, skip=("time/", "throughput/", "async/")):
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for k in x:
            if k.startswith(skip):
                continue
            if x[k] is None:
                assert y[k] is None
            else:
                assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])


def test_max_staleness_zero_is_the_synchronous_loop(text_model, tmp_path):
    """With no staleness allowed, every rollout waits for the newest weights: the engine
    process samples exactly what the in-process engine does."""
    sync = train(make_config({**BASE, "steps": 3, "out": str(tmp_path / "sync")}))
    asyn = train(make_config({**BASE, "steps": 3, "out": str(tmp_path / "async"),
                              "async_engine": True, "max_staleness": 0}))
    a, b = rows(sync), rows(asyn)
    same(a, b, 1e-4)
    assert [m["async/staleness"] for m in b] == [0, 0, 0]


def test_staleness_follows_the_schedule_and_never_exceeds_the_bound(text_model, tmp_path):
    """max_staleness 2, weights pushed every 2 steps: rollout j comes from the oldest pushed
    version >= j - 3 (pushed: 0, 2, 4, 6), so the staleness runs 0 1 2 1 2 1 2 — and α, the
    policy change between the engine's weights and the trainer's, grows with it."""
    run = train(make_config({**BASE, "steps": 7, "lr": 1e-3, "out": str(tmp_path / "run"),
                             "async_engine": True, "max_staleness": 2, "sync_every": 2}))
    m = rows(run)
    staleness = [x["async/staleness"] for x in m]
    assert staleness == [0, 1, 2, 1, 2, 1, 2]
    assert max(staleness) <= 2
    assert [x["async/engine_version"] for x in m] == [0, 0, 0, 2, 2, 4, 4]
    # Step 1 samples from the trainer's own weights: |α| is the kernel gap alone. Staler
    # rollouts carry the updates the engine has not seen.
    assert "mismatch/kernel_gap_abs_mean" in m[0]
    assert all("mismatch/kernel_gap_abs_mean" not in x for x in m[1:])
    gap = m[0]["mismatch/alpha_abs_mean"]
    assert all(x["mismatch/alpha_abs_mean"] > 3 * gap for x in m[2:])
    # a version pushed after a step that changed the weights changed engine weights
    assert m[0]["sync/changed_frac"] == 0.0 and m[3]["sync/changed_frac"] > 0.1


def test_async_run_resumes_exactly(text_model, tmp_path):
    """Stop after step 2 (its checkpoint holds the pushed versions rollouts 3 and 4 need) and
    resume: the metrics of steps 3-4 equal those of a run that never stopped."""
    cfg = {**BASE, "async_engine": True, "max_staleness": 1, "save_every": 2}
    whole = train(make_config({**cfg, "steps": 4, "out": str(tmp_path / "whole")}))
    part = train(make_config({**cfg, "steps": 2, "out": str(tmp_path / "part")}))
    train(make_config({**cfg, "steps": 4, "out": str(part)}), resume=True)
    same(rows(whole), rows(part), 1e-6, skip=("time/", "throughput/", "async/wait"))


def test_a_dead_engine_process_stops_the_run_with_a_clear_error(text_model, tmp_path):
    import psutil
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "parity", "train", "--task", "neg-length",
                             "--model", "text-xs", "--steps", "200", "--async-engine",
                             "--no-progress", "--report-to", "none", "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.5)
        engine = [c for c in psutil.Process(proc.pid).children()
                  if "spawn_main" in " ".join(c.cmdline())]
        assert len(engine) == 1
        os.kill(engine[0].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "parity: error: the engine process stopped (exit code -9)" in err, err[-2000:]


@pytest.mark.parametrize("flags, words", [
    (["--sync-every", "3", "--max-staleness", "1", "--async-engine"],
     ["sync_every=3", "max_staleness + 1 = 2"]),
    (["--sync-every", "2"], ["sync_every=2", "--async-engine"]),
    (["--max-staleness", "-1", "--async-engine"], ["max_staleness=-1"]),
])
def test_bad_async_settings_are_refused(tmp_path, flags, words):
    p = run_main("train", *flags, "--out", str(tmp_path / "run"))
    assert_user_error(p, *words)
    assert not (tmp_path / "run").exists()
