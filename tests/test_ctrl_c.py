"""Ctrl-C stops `parity train --engine vllm` at any phase: exit 130 with one line, no process of
the run left behind, and every finished step on disk as it was written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from parity.runs.checkpoints import steps_on_disk, verify

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vllm_ready")]

# More steps than a run reaches before its Ctrl-C; a checkpoint of every step, all kept.
RUN = ["train", "--model", "text-xs", "--engine", "vllm", "--steps", "40",
       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8",
       "--threads", "1", "--no-progress", "--save-every", "1", "--keep-checkpoints", "0"]


class _Job:
    """`parity train` in a process group of its own, as a shell starts a job: Ctrl-C at the
    terminal sends SIGINT to the whole group. `background`: started as a non-interactive
    shell starts `cmd &` (a script's background job), with SIGINT ignored, which the process
    inherits; otherwise as a terminal starts a foreground job."""

    def __init__(self, out: Path, background: bool):
        self.out, self.lines, self.seen, self.t0 = out, [], {}, time.monotonic()
        before = signal.signal(signal.SIGINT, signal.SIG_IGN) if background else None
        try:
            self.p = subprocess.Popen([sys.executable, "-m", "parity", *RUN, "--out", str(out)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
        finally:
            if before is not None:
                signal.signal(signal.SIGINT, before)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line)

    def watch(self) -> None:
        """Every process the run starts (vLLM's helpers, wandb's service), kept to check
        after the run has ended, even once it has been handed to init."""
        try:
            for c in psutil.Process(self.p.pid).children(recursive=True):
                self.seen.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            pass

    def left(self) -> list[int]:
        def alive(c: psutil.Process) -> bool:
            try:   # is_running: the same process, not a later one given its pid
                return c.is_running() and c.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False
        deadline = time.monotonic() + 10
        while any(map(alive, self.seen.values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [c.pid for c in self.seen.values() if alive(c)]

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def steps_written(self) -> int:
        m = self.out / "metrics.jsonl"
        return m.read_text().count("\n") if m.is_file() else 0   # whole lines only

    def metrics(self) -> list[int]:
        m = self.out / "metrics.jsonl"
        return [json.loads(x)["step"] for x in m.read_text().splitlines()] if m.is_file() else []


def _interrupt(jobs: dict[str, tuple[_Job, object]]) -> None:
    """SIGINT to each job's group the moment its `ready(job)` holds, all watched together;
    each must have exited within 60 s of its Ctrl-C."""
    pending, sent, deadline = dict(jobs), {}, time.monotonic() + 300
    try:
        while pending or any(j.p.poll() is None for j in sent):
            for what, (job, ready) in list(pending.items()):
                job.watch()
                assert job.p.poll() is None, f"the run ended before {what}: {job.err}"
                if ready(job):
                    job.watch()
                    os.killpg(job.p.pid, signal.SIGINT)
                    sent[job] = time.monotonic()
                    del pending[what]
            for job, at in sent.items():
                assert job.p.poll() is not None or time.monotonic() - at < 60, \
                    f"a run still going 60 s after its Ctrl-C: {job.err}"
            assert time.monotonic() < deadline, f"not all of {list(pending)} within 300 s"
            time.sleep(0.05)
    finally:
        for job, _ in jobs.values():
            if job.p.poll() is None:
                os.killpg(job.p.pid, signal.SIGKILL)
                job.p.wait()
            job.reader.join(10)


def _starting_vllm(job: _Job) -> bool:
    return "starting vLLM" in job.err


@pytest.mark.budget(90)
def test_ctrl_c_stops_a_vllm_run_at_any_phase_and_keeps_the_finished_steps(tmp_path,
                                                                          text_model):
    """Ctrl-C while modules import, the moment vLLM starts, and once two steps are on disk (the
    later steps' sampling, update or checkpoint), the runs started both ways a shell starts a
    job; side by side, so that their imports and vLLM's starts share the cores' time."""
    moments = {  # what: (started as a background job, when to press Ctrl-C)
        "the imports": (False, lambda job: time.monotonic() - job.t0 > 1.0),
        "vLLM's start": (True, _starting_vllm),
        "vLLM's start in a foreground job": (False, _starting_vllm),
        "two steps on disk": (True, lambda job: job.steps_written() >= 2),
    }
    jobs = {what: (_Job(tmp_path / f"run-{i}", bg), ready)
            for i, (what, (bg, ready)) in enumerate(moments.items())}
    _interrupt(jobs)
    for what, (job, _) in jobs.items():
        err = job.err
        assert job.p.returncode == 130, (what, job.p.returncode, err)
        assert err.strip().splitlines()[-1] == "parity: interrupted", (what, err)
        assert err.count("parity: interrupted") == 1, (what, err)
        assert "Traceback" not in err and "Exception ignored" not in err, (what, err)
        assert job.left() == [], (what, job.left())
        steps, kept = job.metrics(), steps_on_disk(job.out)
        # Each step's line comes before its checkpoint: a Ctrl-C may cut the last one short.
        assert steps == list(range(1, len(steps) + 1)), (what, steps)
        assert set(steps[:-1]) <= set(kept) <= set(steps), (what, steps, kept)
        assert all(verify(job.out / "checkpoints" / f"step-{s}") is None for s in kept), what
    assert len(jobs["two steps on disk"][0].metrics()) >= 2
