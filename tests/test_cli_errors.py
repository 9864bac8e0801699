"""Bad input: one clear line naming the problem, exit code 2, no traceback, and a run directory
that is either untouched or consistent (every metrics line a complete step)."""

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import assert_user_error

REWARDS = '''
import math
calls = {"n": 0}
def ok(prompts, completions, **kw):
    return [float(len(c)) for c in completions]
def raises(prompts, completions, **kw):
    raise ValueError("reward server unreachable")
def nan(prompts, completions, **kw):
    return [math.nan] * len(completions)
def short(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)
def raises_third(prompts, completions, **kw):
    calls["n"] += 1
    if calls["n"] == 3:
        raise RuntimeError("boom on call 3")
    return [float(len(c)) for c in completions]
def needs_answer(prompts, completions, answer, **kw):
    return [float(c == a) for c, a in zip(completions, answer)]
'''
SMALL = ["--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2",
         "--max-new-tokens", "4", "--no-progress"]


def parity(*args, cwd=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)




@pytest.fixture
def env(tmp_path, text_model):
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": "def f(x):", "answer": "1"}, {"prompt": "import os", "answer": "2"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def data_args(env, reward):
    return ["--task", str(env / "data.jsonl"), "--model", "text-xs",
            "--reward", f"{env / 'rewards.py'}:{reward}"]


@pytest.mark.parametrize("args,words", [
    (["--recipe", "fp64"], ["unknown recipe 'fp64'", "bf16-engine"]),
    (["--engine-dtype", "int8"], ["engine_dtype='int8'", "fp16"]),
    (["--trainer-dtype", "half"], ["trainer_dtype='half'"]),
    (["--steps", "0"], ["steps=0", "> 0"]),
    (["--steps", "-3"], ["steps=-3"]),
    (["--steps", "ten"], ["steps='ten'", "int"]),
    (["--eps-low", "-0.1"], ["eps_low=-0.1"]),
    (["--bogus-flag", "1"], ["unrecognized arguments: --bogus-flag"]),
])
def test_bad_config_values(tmp_path, args, words):
    out = tmp_path / "run"
    p = parity("train", "--out", str(out), *args)
    assert_user_error(p, *words)
    assert not out.exists(), "a refused run must not create its directory"


def test_missing_model_directory(tmp_path):
    p = parity("train", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "run"))
    assert_user_error(p, str(tmp_path / "nope"))
    assert not (tmp_path / "run").exists()


def test_directory_that_is_not_a_model(tmp_path):
    d = tmp_path / "notamodel"
    d.mkdir()
    (d / "readme.txt").write_text("hello")
    p = parity("train", "--model", str(d), "--out", str(tmp_path / "run"))
    assert_user_error(p, str(d), "config.json")


def test_dataset_row_missing_prompt(env):
    (env / "bad.jsonl").write_text('{"prompt": "a"}\n{"answer": "no prompt"}\n')
    p = parity("train", "--task", str(env / "bad.jsonl"), "--model", "text-xs", "--reward",
               f"{env / 'rewards.py'}:ok", "--out", str(env / "run"), *SMALL)
    assert_user_error(p, "row 1", "prompt")
    assert not (env / "run").exists()


@pytest.mark.parametrize("line,words", [
    ('{"prompt": [{"role": "user"}]}', ["row 0", "message 0", "'content'"]),
    ('{"prompt": []}', ["row 0", "non-empty string or a list"]),
    ('{"prompt": 7}', ["row 0", "got int"]),
])
def test_dataset_bad_conversation(env, line, words):
    (env / "bad.jsonl").write_text(line + "\n")
    p = parity("train", "--task", str(env / "bad.jsonl"), "--model", "text-xs", "--reward",
               f"{env / 'rewards.py'}:ok", "--out", str(env / "run"), *SMALL)
    assert_user_error(p, *words)
    assert not (env / "run").exists()


@pytest.mark.parametrize("weights,words", [
    ("1", ["1 values for 2 reward functions"]),
    ("1,x", ["reward_weights='1,x'", "numbers"]),
])
def test_bad_reward_weights(env, weights, words):
    rewards = f"{env / 'rewards.py'}:ok,{env / 'rewards.py'}:ok"
    p = parity("train", "--task", str(env / "data.jsonl"), "--model", "text-xs", "--reward",
               rewards, "--reward-weights", weights, "--out", str(env / "run"), *SMALL)
    assert_user_error(p, *words)
    assert not (env / "run").exists()


def test_dataset_task_without_reward(env):
    p = parity("train", "--task", str(env / "data.jsonl"), "--model", "text-xs",
               "--out", str(env / "run"), *SMALL)
    assert_user_error(p, "--reward")


def test_missing_reward_function(env):
    p = parity("train", *data_args(env, "nosuch"), "--out", str(env / "run"), *SMALL)
    assert_user_error(p, "nosuch")


@pytest.mark.parametrize("reward,words", [
    ("raises", ["raised ValueError", "reward server unreachable"]),
    ("nan", ["nan", "finite"]),
    ("short", ["returned 3 values for 4 completions"]),
])
def test_misbehaving_reward_function(env, reward, words):
    run = env / "run"
    p = parity("train", *data_args(env, reward), "--out", str(run), *SMALL)
    assert_user_error(p, *words)
    assert (run / "config.yaml").is_file()
    assert (run / "metrics.jsonl").read_text() == ""  # consistent: no step completed


def test_reward_failing_mid_run_keeps_completed_steps(env):
    run = env / "run"
    p = parity("train", *data_args(env, "raises_third"), "--out", str(run), *SMALL)
    assert_user_error(p, "boom on call 3")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


def test_reward_columns_reach_the_function(env):
    run = env / "run"
    p = parity("train", *data_args(env, "needs_answer"), "--out", str(run), *SMALL)
    assert p.returncode == 0, p.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_prompt_longer_than_context(env):
    (env / "long.jsonl").write_text(json.dumps({"prompt": "x = 1\n" * 400}) + "\n")
    p = parity("train", "--task", str(env / "long.jsonl"), "--model", "text-xs", "--reward",
               f"{env / 'rewards.py'}:ok", "--out", str(env / "run"), *SMALL)
    assert_user_error(p, "row 0", "context")
    assert not (env / "run").exists()


def test_existing_run_directory_is_never_overwritten(env):
    run = env / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    p = parity("train", *data_args(env, "ok"), "--out", str(run), *SMALL)
    assert_user_error(p, str(run), "not empty")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(x.name for x in run.iterdir()) == ["metrics.jsonl"]


def test_bad_yaml_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: [1, 2\n")
    assert_user_error(parity("train", "--config", str(cfg)), "not valid YAML")
    cfg.write_text("learning_rate: 0.1\n")
    assert_user_error(parity("train", "--config", str(cfg)), "unknown config field "
                      "'learning_rate'")


def _snapshot(path):
    """Every file under a run directory and its bytes: to prove a refusal lost nothing."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, text_model):
    run = tmp_path_factory.mktemp("resume") / "run"
    p = parity("train", "--model", "text-xs", "--out", str(run), "--save-every", "1", *SMALL)
    assert p.returncode == 0, p.stderr
    return run


def _corrupt_all(run):
    for ck in (run / "checkpoints").iterdir():
        (ck / "train.pt").write_bytes(b"not a checkpoint")


@pytest.mark.parametrize("setup,args,words", [
    (None, ["--resume", "{tmp}/nowhere"], ["no such run directory"]),
    ("empty", ["--resume", "{tmp}/empty"], ["not a run directory (no config.yaml)"]),
    ("copy", ["--resume", "{run}", "--lr", "1"], ["--lr cannot change", "steps"]),
    ("copy", ["--resume", "{run}", "--config", "{run}/config.yaml"], ["--config does not apply"]),
    ("bad-yaml", ["--resume", "{run}"], ["config.yaml is not valid", "eps_low=-1"]),
    ("corrupt", ["--resume", "{run}", "--steps", "5"], ["every checkpoint is corrupt"]),
])
def test_bad_resume_directories(tmp_path, finished_run, setup, args, words):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    if setup == "empty":
        (tmp_path / "empty").mkdir()
    elif setup == "bad-yaml":
        cfg = (run / "config.yaml").read_text().replace("eps_low: 0.2", "eps_low: -1")
        (run / "config.yaml").write_text(cfg)
    elif setup == "corrupt":
        _corrupt_all(run)
    before = _snapshot(run)
    p = parity("train", *[a.format(tmp=tmp_path, run=run) for a in args])
    assert_user_error(p, *words)
    assert _snapshot(run) == before, "a refused resume must leave the run directory as it was"
