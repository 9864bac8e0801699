"""Runs that must lose or mix nothing: a resume over a damaged metrics line keeps every readable
step, two runs started at once on one --out never share it, and a refused run leaves no
directory (docs/errors.md, "Nothing lost")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_helpers import assert_user_error, run_main
from parity.cli import main

pytestmark = pytest.mark.e2e

RUN = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
       "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--report-to", "none"]


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True,
                          text=True, timeout=600, **kw)


def steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, text_model) -> Path:
    run = tmp_path_factory.mktemp("four") / "run"
    assert main(["train", *RUN, "--steps", "4", "--save-every", "2", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize("damage", ["cut in half", "not text"])
def test_a_damaged_middle_line_keeps_every_readable_step_on_resume(tmp_path, four_steps, damage):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    bad = lines[1][: len(lines[1]) // 2] if damage == "cut in half" else b"\xff\xfe\x00garbage"
    lines[1] = bad
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    p = run_main("train", "--resume", str(run), "--steps", "6", "--no-progress")
    assert p.returncode == 0, p.stderr
    # Step 2's record is gone with its line; every other finished step stays, byte for byte.
    assert steps(run) == [1, 3, 4, 5, 6]
    kept = (run / "metrics.jsonl").read_bytes().split(b"\n")
    assert kept[:3] == [lines[0], lines[2], lines[3]]
    assert (run / "metrics-unreadable.jsonl").read_bytes() == bad + b"\n"
    warning = [x for x in p.stderr.splitlines() if "could not be read" in x]
    assert len(warning) == 1 and "line 2" in warning[0] and "metrics-unreadable.jsonl" in \
        warning[0] and "step 2 are missing" in warning[0], p.stderr


# Two workers take part in every try: each waits at a barrier of files, then both call `parity
# train` with the same --out in the same millisecond. Importing parity first keeps the starts
# together.
RACE = textwrap.dedent("""
    import contextlib, io, json, os, sys, time
    from pathlib import Path
    from parity.cli import main
    root, me, tries, args = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    results = []
    for i in range(tries):
        (root / f"ready-{i}-{me}").touch()
        while not all((root / f"ready-{i}-{w}").exists() for w in "ab"):
            time.sleep(0.0005)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(["train", *args, "--out", str(root / f"run-{i}")])
            except Exception as e:  # a traceback is a failure of the test, named in its report
                code = f"{type(e).__name__}: {e}"
        results.append({"code": code, "stderr": err.getvalue()})
    (root / f"results-{me}.json").write_text(json.dumps(results))
""")


def test_two_runs_started_together_on_one_out_never_share_it(tmp_path, text_model):
    tries = 12
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    workers = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), w, str(tries), *RUN,
                                 "--steps", "3"], env=env, stderr=subprocess.PIPE, text=True)
               for w in "ab"]
    for w in workers:
        _, err = w.communicate(timeout=600)
        assert w.returncode == 0, err
    a, b = (json.loads((tmp_path / f"results-{w}.json").read_text()) for w in "ab")
    refused_in_use = 0
    for i in range(tries):
        assert steps(tmp_path / f"run-{i}") == [1, 2, 3], i  # one run's steps, each once
        assert sorted([a[i]["code"], b[i]["code"]], key=str) == [0, 2], (i, a[i], b[i])
        loser = a[i] if a[i]["code"] == 2 else b[i]
        errors = [x for x in loser["stderr"].splitlines() if x.startswith("parity: error:")]
        assert len(errors) == 1 and "Traceback" not in loser["stderr"], loser["stderr"]
        assert "is in use by another parity run" in errors[0] or "not empty" in errors[0]
        refused_in_use += "in use" in errors[0]
    print(f"{tries} tries: {refused_in_use} refused while the other held the directory")


def test_a_crashed_run_leaves_its_directory_free_to_resume(tmp_path, text_model):
    """The run directory's lock is one the kernel drops with the process: while the run lives
    a --resume is refused, once it is killed the --resume goes on."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "parity", "train", *RUN, "--steps", "400",
                             "--save-every", "1", "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time
        deadline = time.time() + 300
        # Any checkpoint: step-1 is pruned as soon as newer ones exist.
        ckpts = run / "checkpoints"
        while not (ckpts.is_dir() and any(ckpts.glob("step-*"))) and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be resumed while alive"
        p = cli("train", "--resume", str(run), "--steps", "400", "--no-progress")
        assert_user_error(p, str(run), "is in use by another parity run")
    finally:
        proc.kill()
        proc.wait()
    done = len(steps(run))
    p = cli("train", "--resume", str(run), "--steps", str(done + 1), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert steps(run)[-1] == done + 1


def test_a_run_refused_by_the_memory_check_leaves_no_directory(tmp_path, text_model,
                                                                monkeypatch, capsys):
    from parity.runs import memory
    monkeypatch.setattr(memory, "available", lambda device=None: 2 ** 20)
    out = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--out", str(out)]) == 2
    assert "weights, gradients and optimizer state need" in capsys.readouterr().err
    assert not out.exists()


def test_a_lora_rank_beyond_ulimit_is_refused_before_anything_is_allocated(tmp_path, text_model):
    """A rank typed with extra zeros: the adapters are counted, not allocated, and the real
    limit of the process (`ulimit -v`) is the one the check holds the run to."""
    import resource
    limit = 8 * 2 ** 30
    out = tmp_path / "run"
    p = cli("train", *RUN, "--steps", "2", "--lora-rank", "2000000", "--out", str(out),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    line = assert_user_error(p, "lower --lora-rank", "rank 2000000 adds")
    assert "ulimit -v" in line or "available memory" in line
    assert not out.exists()


OOM = textwrap.dedent("""
    import resource, sys
    from parity.runs import memory
    from parity.cli import main
    # The check misjudges (its figure is a guide): the allocation itself must fail cleanly.
    memory.available = lambda device=None: 1e15
    mapped = memory._read_number("/proc/self/status", "VmSize:")
    limit = int(mapped + 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.exit(main(sys.argv[1:]))
""")


def test_an_allocation_that_fails_mid_run_is_one_line_naming_the_settings(tmp_path, text_model):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", OOM, "train", *RUN[2:], "--model", "text-xs",
                        "--prompts-per-step", "512", "--samples-per-prompt", "8",
                        "--max-new-tokens", "64", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert_user_error(p, "ran out of memory", "--micro-batch", "--prompts-per-step 512",
                      "--max-new-tokens 64")
    assert (out / "config.yaml").is_file()  # what was written stays


def test_a_resume_after_config_yaml_names_another_model_is_one_line(tmp_path, four_steps,
                                                                     arith_model):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("model: text-xs", "model: arith-xs"))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    p = run_main("train", "--resume", str(run), "--steps", "6", "--no-progress")
    assert_user_error(p, "step-4", "do not fit the run's model", "size mismatch",
                      "config.yaml edited to another model")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_run_far_beyond_memory_is_refused_naming_the_setting(text_model, monkeypatch):
    """Beyond twice the memory free the estimate cannot be that wrong (docs/performance.md):
    refused before anything is written, naming the setting and the value that fits."""
    from parity.config import make_config
    from parity.errors import ParityError
    from parity.models.loading import load_policy
    from parity.runs import memory
    model, _ = load_policy(text_model)
    cfg = make_config({"model": "text-xs", "prompts_per_step": 64, "samples_per_prompt": 16,
                       "max_new_tokens": 128}).validate()
    e = memory.estimate(cfg, model, 20)
    monkeypatch.setattr(memory, "available", lambda device=None: e.weights + e.forward / 8)
    assert e.total > memory.REFUSE_FACTOR * (e.weights + e.forward / 8)
    with pytest.raises(ParityError, match=r"may need about .* use --(micro|rollout)-batch \d+"):
        memory.check(cfg, model, 20)
    monkeypatch.setattr(memory, "available", lambda device=None: e.total * 0.8)
    assert "if it is killed, use" in memory.check(cfg, model, 20)  # near: a warning only
