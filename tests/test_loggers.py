"""--report-to: TensorBoard and offline W&B get metrics.jsonl's numbers, each step once, across a
resume too; a backend that is asked for and missing, or unknown, is refused before the run
directory exists; one that breaks is dropped with a warning and metrics.jsonl stays whole."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import assert_user_error, run_main
from parity.cli import main

pytestmark = pytest.mark.e2e

HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_wandb = pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed: pip install "
                                 "'.[test]' (or wandb) to test the W&B backend")
# TensorBoard always; W&B too where it is installed (it is in the test extra).
BACKENDS = "tensorboard,wandb" if HAS_WANDB else "tensorboard"
RUN = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
       "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--lr", "1e-3"]


def jsonl(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same(got, rows, rel):
    """got {step: {name: value}} holds exactly metrics.jsonl's numbers (`step` is the x axis, a
    null is no point)."""
    want = {r["step"]: {k: v for k, v in r.items() if k != "step" and v is not None}
            for r in rows}
    assert sorted(got) == sorted(want)
    for step, metrics in want.items():
        assert len(metrics) > 20
        assert sorted(got[step]) == sorted(metrics), step
        assert got[step] == pytest.approx(metrics, rel=rel, abs=1e-30), step


def tensorboard_scalars(run):
    """{step: {tag: value}} as TensorBoard itself reads the run, failing on a step seen twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            assert tag not in out.setdefault(ev.step, {}), f"{tag} at step {ev.step} twice"
            out[ev.step][tag] = ev.value
    return out


def wandb_segments(run):
    """Each offline W&B run in the run directory, oldest first, as (run record, {step: {name:
    value}}), read back by wandb's own transaction-log reader."""
    segments = []
    for d in sorted((run / "wandb").glob("offline-run-*")):
        p = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(d)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        records = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
        info = next(r["run"] for r in records if r["type"] == "run")
        history = {}
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                assert item["_step"] not in history
                history[item["_step"]] = {k: v for k, v in item.items() if not k.startswith("_")}
        segments.append((d, info, history))
    return segments


def test_backends_log_the_jsonl_numbers(tmp_path, text_model, capfd):
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "3", "--report-to", BACKENDS, "--out", str(run)]) == 0
    rows = jsonl(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_same(tensorboard_scalars(run), rows, rel=1e-6)  # TensorBoard stores float32
    if HAS_WANDB:
        assert "wandb" not in capfd.readouterr().err.lower()  # silent: no banner, no login
        [(_, info, history)] = wandb_segments(run)
        assert info["run_id"] == (run / "wandb-id").read_text().strip()
        assert info["project"] == "parity" and info["display_name"] == "run"
        assert info["config"]["update"]["lr"] == 1e-3
        assert_same(history, rows, rel=1e-12)


@needs_wandb
def test_auto_leaves_out_wandb_under_its_own_off_switch_and_a_named_wandb_still_logs(
        tmp_path, text_model, monkeypatch):
    """`WANDB_MODE=disabled` (wandb's switch; the suite sets it, tests/conftest.py): `auto`
    takes TensorBoard alone and does not import wandb; `--report-to wandb` still logs."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    auto, named = tmp_path / "auto", tmp_path / "named"
    assert main(["train", *RUN, "--steps", "1", "--report-to", "auto", "--out", str(auto)]) == 0
    assert (auto / "tensorboard").is_dir() and not (auto / "wandb").exists()
    assert main(["train", *RUN, "--steps", "1", "--report-to", "wandb", "--out", str(named)]) == 0
    [(_, _, history)] = wandb_segments(named)
    assert_same(history, jsonl(named), rel=1e-12)
    monkeypatch.delenv("WANDB_MODE")
    assert main(["train", *RUN, "--steps", "1", "--report-to", "auto",
                 "--out", str(tmp_path / "on")]) == 0
    assert (tmp_path / "on" / "wandb").is_dir()


def test_resume_logs_each_step_once(tmp_path, text_model):
    """A run that stopped after step 6's metrics but before its checkpoint resumes from step 4:
    the backends drop 5 and 6 with metrics.jsonl and hold the recomputed ones (whose timings
    differ from the first)."""
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "6", "--save-every", "2", "--report-to", BACKENDS,
                 "--out", str(run)]) == 0
    first = jsonl(run)
    shutil.rmtree(run / "checkpoints" / "step-6")
    assert main(["train", "--resume", str(run), "--steps", "8", "--no-progress"]) == 0
    rows = jsonl(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[4]["time/step_s"] != first[4]["time/step_s"]  # step 5 really was run again
    assert len(list((run / "tensorboard").iterdir())) == 2   # one event file per process
    assert_same(tensorboard_scalars(run), rows, rel=1e-6)
    if HAS_WANDB:
        (d1, info1, h1), (d2, info2, h2) = wandb_segments(run)
        run_id = (run / "wandb-id").read_text().strip()
        assert info1["run_id"] == info2["run_id"] == run_id  # the same W&B run, continued
        assert run_id in d1.name and run_id in d2.name  # (-1 added when in the same second)
        assert sorted(h1) == list(range(1, 7))
        assert_same(h2, rows[4:], rel=1e-12)


def test_a_backend_that_breaks_is_dropped_and_metrics_stay_whole(tmp_path, text_model, capsys):
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--save-every", "1", "--report-to",
                 "tensorboard", "--out", str(run)]) == 0
    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").write_text("not a directory")  # TensorBoard cannot start
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "parity: warning: tensorboard logging did not start (FileExistsError" in err
    assert [r["step"] for r in jsonl(run)] == [1, 2, 3, 4]


# Runs parity's CLI in a process where the named packages cannot be imported, exactly as if
# they were not installed (Python's own None-in-sys.modules block).
WITHOUT = ("import sys; sys.modules.update({m: None for m in sys.argv.pop(1).split(',')}); "
           "from parity.cli import main; sys.exit(main(sys.argv[1:]))")


def parity_without(blocked, *args):
    return subprocess.run([sys.executable, "-c", WITHOUT, blocked, *args], capture_output=True,
                          text=True, timeout=300)




@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_requested_backend_that_is_not_installed_is_refused_first(tmp_path, name):
    run = tmp_path / "run"
    p = parity_without(name, "train", *RUN, "--steps", "1", "--report-to", f"tensorboard,{name}",
                       "--out", str(run))
    assert_user_error(p, f"report_to={name}", f"pip install {name}")
    assert not run.exists()


def test_auto_takes_what_is_installed(tmp_path, text_model):
    run = tmp_path / "run"
    p = parity_without("tensorboard,wandb", "train", *RUN, "--steps", "1", "--out", str(run))
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr
    assert sorted(x.name for x in run.iterdir()) == ["checkpoints", "config.yaml",
                                                     "metrics.jsonl", "task.json"]


def test_unknown_backend_is_a_user_error(tmp_path):
    run = tmp_path / "run"
    p = run_main("train", *RUN, "--report-to", "tensorboard,foo", "--out", str(run))
    assert_user_error(p, "report_to", "'foo'")
    assert not run.exists()


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_a_run_without_home_prints_nothing_of_wandb(tmp_path, text_model):
    """With HOME unset, wandb-core cannot find its log directory and used to print every line
    of its own log to stderr on a run that succeeded."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--model", "text-xs",
                        "--prompts-per-step", "2", "--samples-per-prompt", "2",
                        "--max-new-tokens", "4", "--steps", "1", "--threads", "1",
                        "--report-to", "wandb", "--no-progress", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    noise = [x for x in p.stderr.splitlines() if " INFO " in x or " ERROR " in x]
    assert noise == [], p.stderr
