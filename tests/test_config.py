"""Config precedence, recipes, YAML round trip and validation."""

import dataclasses

import pytest

from parity.cli import build_parser, config_from_args
from parity.config import RECIPES, TASK_DEFAULTS, Config, dump_yaml, load_yaml, make_config
from parity.errors import ParityError


def cfg_from(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_field_is_documented():
    for f in dataclasses.fields(Config):
        assert len(f.metadata.get("help", "")) > 15, f.name


def test_recipe_sets_precision_and_flags_override():
    c = cfg_from(["--recipe", "fp16"])
    assert (c.engine_dtype, c.trainer_dtype, c.ratio_source) == ("fp16", "fp16", "engine")
    c = cfg_from(["--recipe", "fp16", "--engine-dtype", "bf16", "--eps-high", "0.28"])
    assert (c.engine_dtype, c.trainer_dtype, c.eps_high, c.eps_low) == ("bf16", "fp16", 0.28, 0.2)


def test_task_defaults_then_yaml_then_flags(tmp_path):
    assert cfg_from(["--task", "arith"]).steps == TASK_DEFAULTS["arith"]["steps"]
    y = tmp_path / "c.yaml"
    y.write_text("task: arith\nsteps: 7\nlr: 3.0e-4\nrecipe: bf16\neps-low: null\n")
    c = cfg_from(["--config", str(y)])
    assert (c.task, c.steps, c.lr, c.recipe, c.trainer_dtype, c.eps_low) == (
        "arith", 7, 3e-4, "bf16", "bf16", None)
    c = cfg_from(["--config", str(y), "--steps", "9"])
    assert c.steps == 9 and c.lr == 3e-4


def test_yaml_round_trip(tmp_path):
    c = cfg_from(["--recipe", "fp32", "--task", "arith", "--top-k", "5", "--no-progress"])
    dump_yaml(c, tmp_path / "config.yaml")
    again = make_config(load_yaml(tmp_path / "config.yaml"))
    assert again == c


def test_recipes_are_valid_configs():
    for name in RECIPES:
        c = make_config({"recipe": name})
        for k, v in RECIPES[name].settings.items():
            assert getattr(c, k) == v


@pytest.mark.parametrize("field,value,words", [
    ("top_p", -0.1, "top_p"), ("temperature", 0, "temperature"), ("minibatches", 3, "divisible"),
    ("ratio_source", "old", "ratio_source"), ("optimizer", "lion", "optimizer"),
    ("eps_low", 1.0, "eps_low"), ("lr", float("nan"), "lr"),
])
def test_invalid_values_are_refused(field, value, words):
    with pytest.raises(ParityError, match=words):
        make_config({field: value})


@pytest.mark.parametrize("values,words", [
    ({"correction": "token-tis"}, "needs ratio_source=recompute"),
    ({"recipe": "bf16-shadow", "correction": "seq-mis"}, "needs ratio_source=recompute"),
    ({"eps_high": -0.1}, "eps_high=-0.1 must be a finite number >= 0"),
    ({"seq_eps_low": -1e-4, "objective": "gspo"}, "seq_eps_low"),
    ({"objective": "gspo", "eps_high": 0.28}, "GSPO|gspo clips the sequence ratio"),
    ({"objective": "pg-is", "eps_low": 0.1}, "has no clip"),
    ({"objective": "ppo-clip", "seq_eps_high": 1e-3}, "GSPO's sequence clip range"),
    ({"recipe": "tis", "is_cap": 0.5}, "is_cap"),
    ({"recipe": "seq-mis", "correction": "geo-rs", "geo_cap": 0.9}, "geo_cap"),
    ({"objective": "online-dpo", "samples_per_prompt": 1}, "samples_per_prompt must be >= 2"),
    ({"objective": "online-dpo", "dpo_ref": "teacher"}, "dpo_ref"),
    ({"objective": "ppo-value", "gae_lambda": 1.5}, "gae_lambda"),
    ({"objective": "ppo-value", "value_clip": 0}, "value_clip"),
    ({"loss_agg": "sum"}, "loss_agg"),
])
def test_invalid_combinations_are_refused(values, words):
    with pytest.raises(ParityError, match=words):
        make_config(values)


def test_recipe_presets_do_not_count_as_user_clip_ranges():
    """GSPO on a recipe (whose token clip range it ignores) is fine, and so is a config.yaml
    written by an earlier run, which repeats every field."""
    for recipe in RECIPES:
        c = make_config({"recipe": recipe, "objective": "gspo"})
        assert c.objective == "gspo"
    c = make_config({"recipe": "wide-eps", "objective": "gspo"})
    assert c.seq_eps_high == 8e-4 and make_config(c.to_dict()) == c


def test_dataset_task_needs_a_model():
    with pytest.raises(ParityError, match="--model"):
        make_config({"task": "data.jsonl"})


def test_task_default_models_are_testbed_models():
    from parity import testbed
    from parity.models import pretrained
    for task, d in TASK_DEFAULTS.items():
        assert d["model"] in testbed.SPECS or d["model"] in pretrained.SOURCES, task
    assert TASK_DEFAULTS["neg-length"]["model"] == testbed.DEFAULT_TEXT
    assert TASK_DEFAULTS["arith"]["model"] == testbed.DEFAULT_ARITH
    assert TASK_DEFAULTS["neg-length-chat"]["model"] == "smollm2-135m"


# -- the config file's reader: aliases, repeated fields, values quoted -----------------------

def _laughs(levels: int) -> str:
    """Nested YAML aliases in one field's value, each level nine of the one before: a few
    hundred bytes that stand for 9**levels values."""
    names = "abcdefghi"[:levels]
    parts = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip(names, names[1:]):
        parts.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "task: {" + ", ".join(parts) + "}\n"


def test_nested_aliases_are_refused_as_they_are_read(tmp_path):
    y = tmp_path / "laughs.yaml"
    y.write_text(_laughs(9))   # 9**9 values in 358 bytes: str() of it needs GBs
    assert len(y.read_bytes()) < 400
    with pytest.raises(ParityError) as e:
        load_yaml(y)
    msg = str(e.value)
    assert msg.startswith(f"config file {y}, line 1, column ")
    assert "more than 10000 values" in msg and "a field holds one value" in msg
    assert len(msg) < 300


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    y = tmp_path / "loop.yaml"
    y.write_text("task: &a [1, *a]\n")
    with pytest.raises(ParityError, match=r"line 1, column 14: alias \*a is inside the value"):
        load_yaml(y)


def test_aliases_of_single_values_still_load(tmp_path):
    y = tmp_path / "anchors.yaml"
    y.write_text("eps-low: &eps 0.1\neps_high: *eps\nsteps: 3\n")
    c = make_config(load_yaml(y))
    assert (c.eps_low, c.eps_high, c.steps) == (0.1, 0.1, 3)


@pytest.mark.parametrize("text,words", [
    ("seed: 1\nsteps: 5\nseed: 2\n", ["field 'seed' is given twice, on lines 1 and 3"]),
    ("max-new-tokens: 4\nsteps: 5\nmax_new_tokens: 8\n",
     ["field 'max_new_tokens' is given twice (as 'max-new-tokens' and 'max_new_tokens'), "
      "on lines 1 and 3"]),
])
def test_a_field_given_twice_is_refused_naming_both_lines(tmp_path, text, words):
    y = tmp_path / "twice.yaml"
    y.write_text(text)
    with pytest.raises(ParityError) as e:
        load_yaml(y)
    for w in words:
        assert w in str(e.value)


def test_a_merged_key_may_be_overridden(tmp_path):
    """`<<: {...}` then a key beside it is YAML's way to override, not a repeated key."""
    y = tmp_path / "merge.yaml"
    y.write_text("<<: {seed: 1, steps: 4}\nseed: 2\n")
    c = make_config(load_yaml(y))
    assert (c.seed, c.steps) == (2, 4)


@pytest.mark.parametrize("value,kind", [([1, 2], "list"), ({"a": 1}, "mapping"),
                                        (b"\x00", "binary value")])
def test_a_field_takes_one_value_not_a_collection(value, kind):
    with pytest.raises(ParityError, match=f"task must be one str value, not a YAML {kind}"):
        make_config({"task": value})


@pytest.mark.parametrize("field,value", [
    ("recipe", "x" * 100_000), ("engine_dtype", "y" * 100_000), ("device", "z" * 100_000),
    ("steps", "9" * 50_000 + "x"), ("report_to", "w" * 100_000), ("lr", "1" * 100_000 + "q"),
])
def test_a_long_value_is_quoted_cut_short(field, value):
    with pytest.raises(ParityError) as e:
        make_config({field: value})
    msg = str(e.value)
    assert "..." in msg and len(msg) < 300, msg[:400]


@pytest.mark.e2e
def test_a_config_file_of_aliases_is_one_line_in_little_memory(tmp_path):
    """The whole command, under a 3 GB address-space limit that the aliases' expansion would
    pass: one line, exit 2, and no run directory."""
    import resource
    import subprocess
    import sys

    from cli_helpers import assert_user_error
    y = tmp_path / "laughs.yaml"
    y.write_text(_laughs(9))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--config", str(y), "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    line = assert_user_error(p, str(y), "a field holds one value")
    assert len(line) < 300
    assert not (tmp_path / "run").exists()
