"""`parity sweep`: the grid, parallel workers, skipping finished runs, keeping unfinished ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.cli import main
from parity.experiments.sweep import EARLY, WINDOW, peak_reward, steps_to_threshold

GRID = ["sweep", "--recipes", "fp32,bf16-engine", "--seeds", "0,1", "--models", "text-xs",
        "--steps", "3", "--max-new-tokens", "8", "--prompts-per-step", "2",
        "--samples-per-prompt", "4", "--workers", "2", "--no-progress"]


@pytest.mark.e2e
def test_sweep_runs_the_grid_and_skips_finished_runs(tmp_path, text_model, capsys):
    out = tmp_path / "sw"
    assert main([*GRID, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["runs"]) == sorted(
        f"neg-length-text-xs-{r}-s{s}" for r in ("fp32", "bf16-engine") for s in (0, 1))
    assert all(r["ok"] and r["steps"] == 3 for r in summary["runs"].values())
    groups = summary["groups"]
    assert groups["neg-length-text-xs-bf16-engine"]["beta_abs_mean"] > 0
    assert groups["neg-length-text-xs-fp32"]["beta_abs_mean"] == 0.0  # fp32 both sides
    # each run's mismatch over its first and its last steps, from its own metrics.jsonl
    run = out / "runs" / "neg-length-text-xs-bf16-engine-s0"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    mine = summary["runs"]["neg-length-text-xs-bf16-engine-s0"]
    for end, part in (("first", rows[:EARLY]), ("last", rows[-EARLY:])):
        kl = [r["mismatch/kl_k3"] for r in part]
        assert mine[f"kl_k3_{end}"] == pytest.approx(sum(kl) / len(kl))
    assert (out / "sweep.png").stat().st_size > 5000 and (out / "report.html").is_file()
    capsys.readouterr()

    # A crashed run: its directory lacks the final checkpoint. Rerunning keeps it aside and
    # redoes only that run; the finished ones are skipped.
    crashed = out / "runs" / "neg-length-text-xs-fp32-s1"
    import shutil
    shutil.rmtree(crashed / "checkpoints")
    assert main([*GRID, "--out", str(out)]) == 0
    rerun = json.loads((out / "summary.json").read_text())
    again = rerun["runs"]
    assert again["neg-length-text-xs-fp32-s0"].get("skipped") is True
    # a skipped run keeps the time its own invocation measured; the sweep's time adds up both
    first = summary["runs"]["neg-length-text-xs-fp32-s0"]["seconds"]
    assert first > 0 and again["neg-length-text-xs-fp32-s0"]["seconds"] == first
    assert rerun["seconds"] > summary["seconds"]
    assert "skipped" not in again["neg-length-text-xs-fp32-s1"]
    assert again["neg-length-text-xs-fp32-s1"]["set_aside"].endswith(".incomplete-1")
    assert (out / "runs" / "neg-length-text-xs-fp32-s1.incomplete-1" / "metrics.jsonl").is_file()
    assert (crashed / "checkpoints" / "step-3").is_dir()
    capsys.readouterr()

    # A finished run whose metrics.jsonl was damaged (a stray byte that is not UTF-8) is not
    # finished: it is set aside and run again, never a crash of the whole sweep.
    damaged = out / "runs" / "neg-length-text-xs-bf16-engine-s0"
    (damaged / "metrics.jsonl").write_bytes(b"\xff" + (damaged / "metrics.jsonl").read_bytes())
    assert main([*GRID, "--out", str(out)]) == 0
    third = json.loads((out / "summary.json").read_text())["runs"]
    assert third["neg-length-text-xs-bf16-engine-s0"]["set_aside"].endswith(".incomplete-1")
    assert third["neg-length-text-xs-bf16-engine-s0"]["ok"]
    assert third["neg-length-text-xs-fp32-s1"].get("skipped") is True


@pytest.mark.parametrize("args,words", [
    (["--recipes", "fp32,nope"], "unknown recipe 'nope'"),
    (["--recipes", "fp32", "--seeds", "a,b"], "comma-separated list of int"),
    (["--recipes", "fp32", "--correction", "token-tis"], "needs ratio_source=recompute"),
    (["--recipes", "fp32,fp32"], "share a directory"),
])
def test_bad_grids_are_refused_before_any_run(tmp_path, capsys, args, words):
    code = main(["sweep", *args, "--out", str(tmp_path / "sw"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert not (tmp_path / "sw").exists()


def test_steps_to_threshold_uses_a_trailing_window():
    rows = [{"step": i + 1, "completion/len_mean": v}
            for i, v in enumerate([20, 10, 1, 1, 1, 1, 1, 1, 1])]
    # trailing 5-step means: 6.6 at step 5, 2.8 at step 6, 1.0 at step 7
    assert steps_to_threshold(rows, "neg-length") == 7
    assert steps_to_threshold(rows[:6], "neg-length") is None
    assert steps_to_threshold([{"step": 1, "reward/mean": 1.0}] * 5, "arith") == 1
    assert steps_to_threshold(rows, "my-data.jsonl") is None  # no threshold for a dataset


def test_peak_reward_is_the_best_trailing_window_mean():
    assert WINDOW == 5
    rows = [{"reward/mean": r} for r in (0.1, 0.5, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2)]
    # window means 0.38, 0.40, 0.34, 0.20: one lucky step (0.9) alone is not the peak
    assert peak_reward(rows) == pytest.approx(0.40)
    assert peak_reward(rows[:4]) is None


@pytest.mark.e2e
def test_a_sweep_continues_another_sweeps_runs_as_one_longer_run(tmp_path, text_model):
    """`continue_from` (the reproduction's long horizon): each run starts as a copy of the
    same-named run of the earlier sweep and trains on; its metrics equal a run that had the
    longer budget from the start, and the earlier sweep is left as it was."""
    from parity.experiments.sweep import SweepSpec, run_sweep

    def spec(steps, **kw):
        return SweepSpec(recipes=["tis"], seeds=[0], models=["text-xs"], workers=1,
                         overrides={"steps": steps, "max_new_tokens": 8, "prompts_per_step": 2,
                                    "samples_per_prompt": 4}, **kw)
    short, cont, whole = tmp_path / "short", tmp_path / "cont", tmp_path / "whole"
    run_sweep(spec(2), short, progress=False, report=False)
    before = (short / "runs" / "neg-length-text-xs-tis-s0" / "metrics.jsonl").read_bytes()
    summary = run_sweep(spec(4, continue_from=short), cont, progress=False, report=False)
    run_sweep(spec(4), whole, progress=False, report=False)

    name = "neg-length-text-xs-tis-s0"
    entry = summary["runs"][name]
    assert entry["ok"] and entry["steps"] == 4
    assert entry["continued"] == str(short / "runs" / name)
    assert _rows(cont / "runs" / name) == _rows(whole / "runs" / name)
    # steps 1-2 were not trained again: their lines, step times included, are the earlier run's
    assert (cont / "runs" / name / "metrics.jsonl").read_bytes().startswith(before)
    assert (short / "runs" / name / "metrics.jsonl").read_bytes() == before
    assert not (short / "runs" / name / "checkpoints" / "step-4").exists()
    assert "steps: 4" in (cont / "runs" / name / "config.yaml").read_text()
    # A second invocation finds it finished and skips it.
    again = run_sweep(spec(4, continue_from=short), cont, progress=False, report=False)
    assert again["runs"][name].get("skipped") is True


def _rows(run):
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "throughput/"))}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"   # a zombie has ended; only its exit status waits to be read


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_a_sweep_stops_its_workers(tmp_path, text_model):
    """A sweep killed outright (SIGKILL: it can do nothing itself) must not leave its workers
    training for nobody on the machine's cores."""
    out = tmp_path / "sw"
    args = [a for a in GRID if a not in ("--steps", "3")]
    proc = subprocess.Popen([sys.executable, "-m", "parity", *args, "--steps", "200",
                             "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("runs/*/metrics.jsonl")):   # the workers are training
            assert proc.poll() is None and time.monotonic() < deadline, "no run started"
            time.sleep(0.5)
        workers = [c for c in _children(proc.pid) if "spawn_main" in
                   Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)
    finally:
        proc.kill()
