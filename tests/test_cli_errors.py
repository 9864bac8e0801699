"""Bad input: one clear line naming the problem, exit code 2, no traceback, and a run directory
that is either untouched or consistent (every metrics line a complete step)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_helpers import assert_user_error, cli, run_main

pytestmark = pytest.mark.e2e

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
def huge(prompts, completions, **kw):
    return [1e39] * len(completions)
def large(prompts, completions, **kw):
    return [1e29] * len(completions)
def raises_third(prompts, completions, **kw):
    calls["n"] += 1
    if calls["n"] == 3:
        raise RuntimeError("boom on call 3")
    return [float(len(c)) for c in completions]
def needs_answer(prompts, completions, answer, **kw):
    return [float(c == a) for c, a in zip(completions, answer)]
def exits(prompts, completions, **kw):
    import sys
    sys.exit("grader: no answer found")
def with_none(prompts, completions, **kw):
    return [1.0, None] + [0.0] * (len(completions) - 2)
def consumes(prompts, completions, **kw):
    out = []
    while completions:
        out.append(float(len(completions.pop())))
    return out[::-1]
async def async_ok(prompts, completions, **kw):
    return [float(len(c)) for c in completions]
'''
SMALL = ["--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2",
         "--max-new-tokens", "4", "--no-progress"]


# Refusals run through the entry point in this process (cli_helpers.run_main); the test of what
# libraries print beside the error runs its own process.
parity = run_main


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
    ("huge", ["returned 1e+39 for completion 0", "prompt row", "within +-1e+30"]),
    ("exits", ["reward function", ":exits called sys.exit('grader: no answer found')",
               "while scoring prompt rows", "must return its values"]),
    ("with_none", ["list of numbers; value 1 (prompt row", "is None (NoneType)"]),
])
def test_misbehaving_reward_function(env, reward, words):
    run = env / "run"
    p = parity("train", *data_args(env, reward), "--out", str(run), *SMALL)
    assert_user_error(p, *words)
    assert (run / "config.yaml").is_file()
    assert (run / "metrics.jsonl").read_text() == ""  # consistent: no step completed


def test_a_reward_path_that_is_a_directory_says_so(env):
    (env / "rewards_dir.py").mkdir()
    p = parity("train", "--task", str(env / "data.jsonl"), "--model", "text-xs", "--reward",
               f"{env / 'rewards_dir.py'}:ok", "--out", str(env / "run"), *SMALL)
    assert_user_error(p, "rewards_dir.py is a directory, not a Python file")
    assert not (env / "run").exists()


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


@pytest.mark.parametrize("reward", ["consumes", "async_ok"])
def test_a_reward_that_consumes_its_list_or_is_async_trains(env, reward):
    """TRL hands a reward function lists it may consume, and awaits an `async def` one."""
    run = env / "run"
    p = parity("train", *data_args(env, reward), "--out", str(run), *SMALL)
    assert p.returncode == 0, p.stderr
    assert "never awaited" not in p.stderr
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
    ("latin-yaml", ["--resume", "{run}"], ["config.yaml is not UTF-8 text", "byte 0xe9"]),
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
    elif setup == "latin-yaml":
        with open(run / "config.yaml", "ab") as f:
            f.write("# edited by hand: caf\u00e9\n".encode("latin-1"))
    elif setup == "corrupt":
        _corrupt_all(run)
    before = _snapshot(run)
    p = parity("train", *[a.format(tmp=tmp_path, run=run) for a in args])
    assert_user_error(p, *words)
    assert _snapshot(run) == before, "a refused resume must leave the run directory as it was"


# ---- files that are not UTF-8 text, or not what their name says (docs/errors.md, "Files")

def _saved_dataset(path: Path) -> Path:
    import datasets
    datasets.Dataset.from_list([{"prompt": "def f(x):"}]).save_to_disk(str(path))
    (path / "state.json").write_bytes(b"\xff\xfe" + (path / "state.json").read_bytes())
    return path


def _latin_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    strings = pa.array([b"ok", b"caf\xe9"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": strings}), path)  # parquet checks no encoding
    return path


BAD_DATASETS = {
    "latin-1 jsonl": ("d.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n',
                      ["not UTF-8 text", "byte 0xe9 at offset 32 (line 2)"]),
    "latin-1 json array": ("d.json", b'[{"prompt": "ok"},\n {"prompt": "caf\xe9"}]',
                           ["not UTF-8 text", "(line 2)"]),
    "an image": ("d.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["byte 0x89 at offset 0"]),
    "NUL bytes": ("d.jsonl", b'{"prompt": "ok"}\n\x00\x00\x00\n', ["binary", "offset 17 (line 2)"]),
    "bad JSON line": ("d.jsonl", b'{"prompt": "ok"}\n{"prompt": }\n', ["line 2", "not valid JSON"]),
    "bad JSON array": ("d.json", b'[{"prompt": "ok"},\n {"prompt": }]', ["not valid JSON",
                                                                          "line 2, column"]),
    "empty": ("d.jsonl", b"", ["is empty"]),
    "blank lines only": ("d.jsonl", b"\n\n  \n", ["is empty"]),
    "not a row": ("d.jsonl", b'{"prompt": "ok"}\n[1, 2]\n', ["line 2", "JSON object"]),
    "not parquet": ("d.parquet", b"PAR1 this is not parquet", ["not a readable parquet file"]),
    "parquet latin-1": ("d.parquet", _latin_parquet, ["row 1, column 'prompt'", "not UTF-8"]),
    "saved dataset": ("saved", _saved_dataset, ["state.json", "byte 0xff at offset 0"]),
}


@pytest.mark.parametrize("case", list(BAD_DATASETS))
def test_unreadable_dataset_is_one_line_naming_file_and_place(env, capsys, case):
    name, content, words = BAD_DATASETS[case]
    path = env / name
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    p = run_main("train", "--task", path, "--model", "text-xs", "--reward",
                   f"{env / 'rewards.py'}:ok", "--out", env / "run", *SMALL)
    assert_user_error(p, str(path), *words)
    assert not (env / "run").exists()


def test_reward_and_config_files_that_are_not_utf8(env, capsys, monkeypatch):
    (env / "latin_reward.py").write_bytes(b'NAME = "caf\xe9"\ndef ok(p, c, **k):\n'
                                          b'    return [1.0] * len(c)\n')
    for spec in (f"{env / 'latin_reward.py'}:ok", "latin_reward:ok"):  # a file, a module
        monkeypatch.chdir(env)
        p = run_main("train", "--task", env / "data.jsonl", "--model", "text-xs",
                       "--reward", spec, "--out", env / "run", *SMALL)
        assert_user_error(p, "latin_reward.py", "not UTF-8", "byte 0xe9 at offset 11 (line 1)")
    # A coding line is Python's own way to say latin-1: such a module is read as Python reads it.
    (env / "declared.py").write_bytes(b"# -*- coding: latin-1 -*-\nNAME = 'caf\xe9'\n"
                                      b"def ok(p, c, **k):\n    return [1.0] * len(c)\n")
    from parity.tasks.rewards import load_reward
    fn, _ = load_reward(f"{env / 'declared.py'}:ok")
    assert fn.__globals__["NAME"] == "caf\u00e9"
    (env / "c.yaml").write_bytes(b"lr: 0.1\nnote: caf\xe9\n")
    assert_user_error(run_main("train", "--config", env / "c.yaml", "--out",
                                 env / "run"), "config file", "not UTF-8", "offset 17 (line 2)")
    (env / "c.yaml").write_bytes(b"lr: [1, 2\n")
    assert_user_error(run_main("train", "--config", env / "c.yaml"),
                      "not valid YAML (line 2, column 1)")
    assert not (env / "run").exists()


@pytest.mark.parametrize("name,content", [
    ("bad.jsonl", b'{"prompt": "ok"}\n{"prompt": }\n'),
    ("bad.parquet", b"PAR1 not parquet"),
    ("saved", None),
])
def test_library_messages_are_not_printed_beside_the_error(env, name, content):
    """`datasets` logs a failure in lines of its own before it raises; `audit` prints nothing
    before its work, so its stderr must be exactly parity's line."""
    path = env / name
    if content is None:
        _saved_dataset(path)
        (path / "state.json").write_text("{}")
        (path / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    else:
        path.write_bytes(content)
    p = cli("audit", "--task", str(path), "--reward", f"{env / 'rewards.py'}:ok", "--model",
            "text-xs", "--out", str(env / "out"), "--no-progress")
    assert_user_error(p, str(path))
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (env / "out").exists()


# ---- a chat template that refuses a message (docs/errors.md, "Models and datasets")

SYSTEMLESS = ("{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
              "{{ raise_exception('System role not supported') }}{%- endif -%}"
              "{{ m['role'] }}: {{ m['content'] }}\n{% endfor -%}"
              "{%- if add_generation_prompt -%}assistant: {% endif -%}")


def test_chat_template_that_refuses_a_role_names_row_and_role(env, text_model, capsys):
    model = env / "systemless"
    shutil.copytree(text_model, model)
    (model / "chat_template.jinja").write_text(SYSTEMLESS)
    rows = [[{"role": "user", "content": "hi"}],
            [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]]
    (env / "chat.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    p = run_main("train", "--task", env / "chat.jsonl", "--model", model, "--reward",
                   f"{env / 'rewards.py'}:ok", "--out", env / "run", *SMALL)
    assert_user_error(p, "row 1", "message 1 (role 'system')", "System role not supported")
    assert not (env / "run").exists()


# ---- rewards beyond float32 (docs/errors.md, "Reward functions")

def test_weighted_rewards_beyond_the_limit_are_refused(env):
    run = env / "run"
    p = parity("train", "--task", str(env / "data.jsonl"), "--model", "text-xs", "--reward",
               f"{env / 'rewards.py'}:large", "--reward-weights", "100", "--out", str(run),
               *SMALL)
    assert_user_error(p, "weighted sum of the rewards is 1e+31", "prompt row", "[100.0]")
    assert (run / "metrics.jsonl").read_text() == ""


# ---- output paths that cannot be a directory (docs/errors.md, "Output paths")

def _report_run(tmp: Path) -> Path:
    run = tmp / "done"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return run


COMMANDS = {
    "train": lambda out, tmp: ["train", "--model", "text-xs", "--out", out, *SMALL],
    "audit": lambda out, tmp: ["audit", "--model", "text-xs", "--out", out, "--no-progress"],
    "audit --scale": lambda out, tmp: ["audit", "--scale", "--models", "text-xs", "--out", out,
                                       "--no-progress"],
    "sweep": lambda out, tmp: ["sweep", "--recipes", "fp32", "--models", "text-xs", "--out", out,
                               "--no-progress"],
    "reproduce": lambda out, tmp: ["reproduce", "--quick", "--out", out, "--no-progress"],
    "fp16-check": lambda out, tmp: ["fp16-check", "--model", "text-xs", "--out", out,
                                    "--no-progress"],
    "report": lambda out, tmp: ["report", str(_report_run(tmp)), "--out", out],
    "testbed --cache": lambda out, tmp: ["testbed", "build", "text-xs", "--cache", out],
}


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory this process may not write. Root may write any directory whatever its mode,
    so as root only a read-only file system serves (/proc/sys in a container); without one the
    case cannot be shown and is skipped."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):
        yield Path("/proc/sys")
        return
    pytest.skip("running as root with no read-only directory: an unwritable --out cannot be made")


@pytest.mark.parametrize("where", ["a file", "under a file"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_output_path_that_cannot_be_a_directory(tmp_path, text_model, capsys, command, where):
    blocker = tmp_path / "in-the-way"
    blocker.write_text("a user's file\n")
    out = blocker if where == "a file" else blocker / "sub" / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    p = run_main(*COMMANDS[command](out, tmp_path))
    line = assert_user_error(p, str(out), f"{blocker} is a file" if where == "under a file"
                             else "is a file, not a directory")
    assert blocker.read_text() == "a user's file\n"
    after = sorted(p.name for p in tmp_path.iterdir() if p.name != "done")
    assert after == [b for b in before if b != "done"], line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_output_path_in_an_unwritable_directory(tmp_path, text_model, capsys, unwritable,
                                                command):
    out = unwritable / "parity-out"
    p = run_main(*COMMANDS[command](out, tmp_path))
    assert_user_error(p, str(out), "cannot be written", f"{unwritable} is not writable")
    assert not out.exists()


@pytest.mark.parametrize("where", ["/proc/parity-out", "/sys/parity-out"])
@pytest.mark.parametrize("command", ["train", "audit", "fp16-check", "testbed --cache"])
def test_output_path_on_a_kernel_file_system(tmp_path, text_model, capsys, command, where):
    if not Path(where).parent.is_dir():
        pytest.skip(f"no {Path(where).parent} here")
    p = run_main(*COMMANDS[command](Path(where), tmp_path))
    assert_user_error(p, where, "cannot", "a file system the kernel makes up")
    assert not Path(where).exists()


def test_a_refusal_while_loading_is_the_only_line(tmp_path):
    """The header is printed once the model has loaded and every check passed."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    p = parity("train", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "run"),
               *SMALL)
    line = assert_user_error(p, str(tmp_path / "model"))
    assert p.stderr.strip().splitlines() == [line]


@pytest.mark.parametrize("args,words", [
    (["--lora-alpha", "16"], ["lora_alpha=16.0 applies to LoRA adapters", "--lora-rank"]),
    (["--lora-targets", "q_proj"], ["lora_targets='q_proj' applies to LoRA adapters"]),
    (["--lora-rank", "4", "--lora-targets", "q_proj,nosuch_proj"],
     ["'nosuch_proj' names no linear layer", "q_proj, up_proj"]),
])
def test_lora_settings_that_would_be_ignored_are_refused(tmp_path, text_model, args, words):
    p = parity("train", "--model", "text-xs", "--out", str(tmp_path / "run"), *SMALL, *args)
    assert_user_error(p, *words)
    assert not (tmp_path / "run").exists()


def test_testbed_list_never_cuts_a_name_and_has_json(cache):
    from parity import testbed
    from parity.models import pretrained
    p = parity("testbed", "list")  # piped: no terminal width
    for name in [*testbed.SPECS, *pretrained.SOURCES]:
        assert f" {name} " in p.stdout, name
    p = parity("testbed", "list", "--json")
    rows = json.loads(p.stdout)["models"]
    assert [r["name"] for r in rows] == [*testbed.SPECS, *pretrained.SOURCES]
    assert {"name", "kind", "built", "about"} <= set(rows[0])


# ---- a deleted working directory (docs/errors.md, "The working directory")

def _in_a_deleted_directory(tmp_path, *args: str):
    """`python -m parity ARGS` started by a shell whose directory was deleted under it."""
    import shlex
    import subprocess
    import sys
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (f"cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))} && "
              f"exec {shlex.quote(sys.executable)} -m parity \"$@\"")
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})


@pytest.mark.parametrize("args", [["--help"], ["train", "--steps", "1"]])
def test_a_deleted_working_directory_is_one_line(tmp_path, args):
    """Before, `train` there stopped in oneMKL as torch loaded (`Intel oneMKL FATAL ERROR:
    Cannot load .../libtorch_cpu.so.`)."""
    out = tmp_path / "run"
    p = _in_a_deleted_directory(tmp_path, *args, *(["--out", str(out)] if args[0] == "train"
                                                   else []))
    line = assert_user_error(p, "the current directory was deleted", "cd to a directory")
    assert p.stderr.splitlines() == [line] and p.stdout == ""
    assert not out.exists()


def test_a_deleted_working_directory_is_one_line_from_the_entry_point(tmp_path, monkeypatch):
    """parity.cli.main itself, the `parity` console script's function, in this process."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    p = run_main("recipes")
    assert_user_error(p, "the current directory was deleted")
    assert p.stdout == ""


def test_a_ctrl_c_while_a_module_imports_is_taken_once_the_import_is_done(tmp_path, monkeypatch):
    """An extension module's initialisation may run Python for C++ (pybind11), and a
    KeyboardInterrupt thrown through it aborts the process (SIGABRT): parity takes an
    interrupt that lands in an import when the import has finished, and then at once."""
    import signal
    import sys
    import time

    from parity import cli as parity_cli
    (tmp_path / "interrupted_mid_import.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(0.2)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.monotonic()
    with parity_cli._CtrlC() as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            import interrupted_mid_import  # noqa: F401
            time.sleep(5)   # the interrupt is taken here, after the import
    assert sys.modules["interrupted_mid_import"].DONE and ctrl_c.seen
    assert time.monotonic() - t0 < 2
    assert signal.getsignal(signal.SIGINT) is not ctrl_c._on_sigint
    sys.modules.pop("interrupted_mid_import")
