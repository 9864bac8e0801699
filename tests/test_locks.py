"""One lock on every output directory (`runs.lock_dir`): of two commands started into one
--out, one proceeds and the other is refused in one line with nothing overwritten; a sweep
never writes into another command's directory; Ctrl-C stops a sweep's queued runs and a rerun
goes on from what finished; a killed run's metrics are read by `report` as `--resume` reads
them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli_helpers import TINY_RUN, assert_user_error, cli
from parity.cli import main
from parity.runs.dirs import lock_dir

SWEEP = ["sweep", "--models", "text-xs", "--max-new-tokens", "8", "--prompts-per-step", "2",
         "--samples-per-prompt", "4", "--no-progress"]


def _metrics(run: Path, steps: int) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in range(1, steps + 1)))


def _listing(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def test_a_report_into_a_held_directory_is_refused_and_writes_nothing(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    _metrics(run, 3)
    with lock_dir(out, "report --out"):   # another parity command writing `out`
        p = cli("report", str(run), "--out", str(out))
        assert_user_error(p, f"report --out {out} is in use by another parity run")
        assert list(out.iterdir()) == []
    p = cli("report", str(run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert (out / "report.html").is_file()


@pytest.mark.e2e   # runs parity in other processes
def test_a_reproduction_into_a_held_or_foreign_directory_is_refused(tmp_path):
    out = tmp_path / "repro"
    with lock_dir(out, "reproduce --out"):
        p = cli("reproduce", "--quick", "--out", str(out), "--no-progress")
        assert_user_error(p, f"reproduce --out {out} is in use by another parity run")
        assert list(out.iterdir()) == []
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")
    before = _listing(run)
    p = cli("reproduce", "--quick", "--out", str(run), "--no-progress")
    assert_user_error(p, f"reproduce --out {run} holds a training run (config.yaml)")
    assert _listing(run) == before


def test_a_lock_refused_leaves_no_directory_it_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with lock_dir(out, "audit --out", empty=True):
            raise RuntimeError("the command failed before writing")
    assert not out.exists()
    kept = tmp_path / "kept"
    with pytest.raises(RuntimeError):
        with lock_dir(kept, "audit --out", empty=True):
            (kept / "audit.json").write_text("{}")
            raise RuntimeError("the command failed after writing")
    assert (kept / "audit.json").is_file()   # work written is never removed by the lock


@pytest.mark.e2e
def test_two_audits_started_together_on_one_out_never_share_it(tmp_path, text_model):
    out = tmp_path / "audit"
    args = [sys.executable, "-m", "parity", "audit", "--model", "text-xs", "--samples", "16",
            "--max-new-tokens", "8", "--no-progress", "--out", str(out)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [(p, *p.communicate(timeout=600)) for p in procs]
    assert sorted(p.returncode for p, _, _ in done) == [0, 2], [e for _, _, e in done]
    loser = next(subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, o, e in done
                 if p.returncode == 2)
    line = assert_user_error(loser, str(out))
    assert "is in use by another parity run" in line or "not empty" in line, line
    # the winner's files are whole and its own
    result = json.loads((out / "audit.json").read_text())
    assert pq.read_table(out / "tokens.parquet").num_rows > 0
    assert result["completions"] == 16
    assert not list(out.glob(".tmp-*"))


def _wait_for(cond, proc: subprocess.Popen, what: str, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert proc.poll() is None, f"the sweep ended before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.1)


def _sweep(out: Path, *args: str) -> subprocess.Popen:
    """`parity sweep` in its own process group, as a terminal runs a foreground job: Ctrl-C
    sends SIGINT to the group."""
    return subprocess.Popen([sys.executable, "-m", "parity", *SWEEP, *args, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.e2e
def test_a_second_sweep_into_a_running_sweep_is_refused_before_touching_it(tmp_path,
                                                                           text_model):
    out = tmp_path / "sw"
    # Steps it never reaches before it is killed below: a first sweep that finished would write
    # its own summary.json, which a slow machine can let happen while the second one starts.
    first = _sweep(out, "--recipes", "fp32", "--steps", "100000", "--workers", "1")
    try:
        run = out / "runs" / "neg-length-text-xs-fp32-s0"
        _wait_for(lambda: (run / "metrics.jsonl").is_file(), first, "a run training")
        inode = run.stat().st_ino
        p = cli(*SWEEP, "--recipes", "fp32", "--steps", "2", "--workers", "1", "--out", str(out))
        assert_user_error(p, f"sweep --out {out} is in use by another parity run")
        assert sorted(x.name for x in (out / "runs").iterdir()) == [run.name]  # none set aside
        assert run.stat().st_ino == inode and first.poll() is None
        assert not (out / "summary.json").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.e2e
def test_a_sweep_into_a_training_run_is_refused_and_writes_nothing(tmp_path, text_model, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--steps", "1", "--out", str(run)]) == 0
    before = _listing(run)
    capsys.readouterr()
    assert main([*SWEEP, "--recipes", "fp32", "--steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"parity: error: sweep --out {run} holds a training run (config.yaml)" in err, err
    assert _listing(run) == before


def _finished(run: Path, steps: int) -> bool:
    m = run / "metrics.jsonl"
    return ((run / "checkpoints" / f"step-{steps}").is_dir() and m.is_file()
            and len(m.read_text().splitlines()) == steps)


def _workers(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.budget(45)
@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_queued_runs_and_a_rerun_goes_on_from_the_finished_ones(tmp_path,
                                                                            text_model):
    """Ctrl-C once the first run of six has finished, two workers busy: no queued run starts
    after it, the running ones stop with the workers, the finished run stays finished, and the
    same command run again skips it and completes the grid. Six, not four: the first two runs
    can finish together and start the other two before the poll sees either, which leaves no
    run queued."""
    out, steps = tmp_path / "sw", 2
    grid = ["--recipes", "fp32,bf16-engine", "--seeds", "0,1,2", "--steps", str(steps),
            "--workers", "2"]
    sweep = _sweep(out, *grid)
    try:
        runs = out / "runs"
        _wait_for(lambda: runs.is_dir() and any(_finished(r, steps) for r in runs.iterdir()),
                  sweep, "a finished run")
        # The job is stopped while its state is read, so the Ctrl-C lands on exactly that state.
        os.killpg(sweep.pid, signal.SIGSTOP)
        started = sorted(r.name for r in runs.iterdir())
        finished = sorted(r.name for r in runs.iterdir() if _finished(r, steps))
        workers = _workers(sweep.pid)
        os.killpg(sweep.pid, signal.SIGINT)
        os.killpg(sweep.pid, signal.SIGCONT)
        _, err = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    assert sweep.returncode == 130, err
    assert err.strip().splitlines()[-1] == "parity: interrupted" and "Traceback" not in err, err
    assert len(started) < 6 and finished
    assert sorted(r.name for r in runs.iterdir()) == started   # nothing started after Ctrl-C
    assert all(_finished(runs / r, steps) for r in finished)
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and not any(map(_alive, workers))

    p = cli(*SWEEP, *grid, "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "summary.json").read_text())["runs"]
    assert len(summary) == 6 and all(r["ok"] and r["steps"] == steps for r in summary.values())
    assert sorted(n for n, r in summary.items() if r.get("skipped")) == finished


def test_report_reads_a_killed_runs_torn_last_line_as_resume_does(tmp_path):
    """A run killed mid-write leaves its last metrics line cut; `--resume` keeps the steps
    before it (runs.truncate_metrics), and `report` reads the file through the same reader."""
    run = tmp_path / "run"
    _metrics(run, 5)
    data = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(data[:-12])   # the kill: line 5 cut, no newline
    p = cli("report", str(run), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert f"parity: warning: {run / 'metrics.jsonl'}: line 5 could not be read" in p.stderr
    assert "<td>4</td>" in (tmp_path / "out" / "report.html").read_text()
    from parity.runs.dirs import metrics_lines
    assert [x.row["step"] for x in metrics_lines(run / "metrics.jsonl") if x.row] == [1, 2, 3, 4]
