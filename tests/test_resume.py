"""Nothing lost: SIGKILL at random moments, corrupt checkpoints, and exact resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.cli import main
from parity.runs.checkpoints import steps_on_disk, verify

pytestmark = pytest.mark.e2e

RUN = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
       "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--lr", "1e-3"]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in rows]


@pytest.mark.budget(60)
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, text_model):
    steps = 16
    ref = tmp_path / "ref"
    assert main(["train", *RUN, "--steps", str(steps), "--save-every", "1", "--out",
                 str(ref)]) == 0
    run = tmp_path / "run"
    env = {**os.environ}
    rng = random.Random(0)
    kills = during_write = 0
    while True:
        if (run / "config.yaml").is_file():
            cmd = ["train", "--resume", str(run), "--no-progress"]
        else:
            cmd = ["train", *RUN, "--steps", str(steps), "--save-every", "1", "--out", str(run)]
        p = subprocess.Popen([sys.executable, "-m", "parity", *cmd], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills >= 5 and during_write >= 1:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            break
        # Aim at a checkpoint write once, at random moments otherwise.
        aim_write = during_write == 0 and kills >= 2
        done_at_start = len(metrics(run)) if (run / "metrics.jsonl").is_file() else 0
        target = done_at_start + rng.randint(1, 3)
        delay = rng.uniform(0.0, 0.15)
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            ckpts = run / "checkpoints"
            if aim_write and ckpts.is_dir() and any(ckpts.glob(".tmp-step-*")):
                p.send_signal(signal.SIGKILL)
                p.wait()
                if any(ckpts.glob(".tmp-step-*")):  # the write really was cut short
                    during_write += 1
                kills += 1
                break
            if not aim_write and (run / "metrics.jsonl").is_file() and \
                    len((run / "metrics.jsonl").read_text().splitlines()) >= target:
                time.sleep(delay)
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                break
            time.sleep(0.0005)
        else:
            if p.returncode is None:
                p.kill()
                pytest.fail("training neither finished nor reached the kill point")
            # It finished before we struck: that run is complete, so the test is over.
            assert p.returncode == 0, p.stderr.read()
            break
        assert p.returncode == -signal.SIGKILL
    assert kills >= 5 and during_write >= 1, (kills, during_write)
    assert metrics(run) == metrics(ref)  # bitwise: same kernels, same thread count
    assert verify(run / "checkpoints" / f"step-{steps}") is None
    assert not list((run / "checkpoints").glob(".tmp-step-*"))
    assert len(steps_on_disk(run)) == 3  # keep_checkpoints


def test_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, text_model, capsys):
    ref = tmp_path / "ref"
    assert main(["train", *RUN, "--steps", "8", "--save-every", "2", "--out", str(ref)]) == 0
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "6", "--save-every", "2", "--out", str(run)]) == 0
    weights = run / "checkpoints" / "step-6" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "8", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint" in err and "step-6 is corrupt" in err and "model.safetensors" in err
    assert metrics(run) == metrics(ref)  # resumed from step 4, recomputed 5..8


def test_resume_refuses_to_change_the_experiment(tmp_path, text_model, capsys):
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--lr", "1"]) == 2
    assert "--lr cannot change" in capsys.readouterr().err
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # finished: no-op
    assert (run / "metrics.jsonl").read_text() == before
