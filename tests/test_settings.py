"""Settings written once: Config's fields drive the train flags, the audit's settings and flags,
the TRL integration's options and every check, and the checks refuse what they should."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
import typing

import pytest

from cli_helpers import run_main
from parity import config
from parity.config import AuditSettings, Config, check_fields, coerce, field_specs, make_config
from parity.config import fields as config_fields
from parity.errors import ParityError

# Numbers with no bound of their own: max_grad_norm <= 0 disables clipping, and sync_every's
# bound depends on max_staleness (a rule of validate's).
UNBOUNDED = {"max_grad_norm", "sync_every"}


@pytest.fixture(scope="module")
def base() -> Config:
    return make_config({})


def _numbers(cls=Config) -> list[str]:
    return [n for n, sp in field_specs(cls).items() if sp.kind in (int, float)]


def _outside(r: config_fields.Range, kind: type) -> list[float]:
    step = 1 if kind is int else 0.5
    out = []
    if r.ge is not None:
        out.append(r.ge - step)
    if r.gt is not None:
        out.append(r.gt)
    if r.le is not None:
        out.append(r.le + step)
    if r.lt is not None:
        out.append(r.lt)
    return out


def _refused(obj, name: str, value) -> str:
    with pytest.raises(ParityError) as e:
        check_fields(dataclasses.replace(obj, **{name: value}))
    msg = str(e.value)
    assert msg.startswith(f"{name}=") and "\n" not in msg, msg
    return msg


def test_every_number_has_a_range_or_a_reason():
    for name in _numbers():
        r = field_specs(Config)[name].range
        assert name in UNBOUNDED or _outside(r, int), f"{name} declares no range"


def test_non_finite_and_out_of_range_numbers_are_refused(base):
    check_fields(base)
    for name in _numbers():
        sp = field_specs(Config)[name]
        bad = [math.nan, math.inf, -math.inf] if sp.kind is float else [math.nan, 1.5]
        for v in bad + _outside(sp.range, sp.kind):
            _refused(base, name, v)
            with pytest.raises(ParityError, match=f"^{name}="):  # the whole validate, too
                dataclasses.replace(base, **{name: v}).validate()


def test_audit_numbers_are_checked_the_same_way():
    a = AuditSettings(model="text", task="neg-length").validate()
    for name in _numbers(AuditSettings):
        sp = field_specs(AuditSettings)[name]
        bad = [math.nan, math.inf] if sp.kind is float else [math.nan, 1.5]
        for v in bad + _outside(sp.range, sp.kind):
            with pytest.raises(ParityError, match=f"^{name}="):
                dataclasses.replace(a, **{name: v}).validate()


def test_bad_choices_are_refused_for_every_literal_field(base):
    literals = {n: sp.choices for n, sp in field_specs(Config).items() if sp.choices}
    assert {"engine_dtype", "trainer_dtype", "ratio_source", "correction", "objective",
            "loss_agg", "dpo_ref", "optimizer", "engine", "parallel", "cpu_fp16"} <= set(literals)
    for name, choices in literals.items():
        msg = _refused(base, name, "bogus")
        assert msg == f"{name}='bogus' is not one of: {', '.join(choices)}"
        for c in choices:
            assert c in msg


def test_tuples_derive_from_the_literals():
    assert config.DTYPES == ("fp32", "bf16", "fp16")
    assert config.DTYPES == field_specs(Config)["engine_dtype"].choices
    assert config.RATIO_SOURCES == typing.get_args(config.RatioSource)


def test_objective_choices_are_the_objective_registry():
    from parity.objectives import OBJECTIVES
    assert field_specs(Config)["objective"].choices == tuple(OBJECTIVES)


@pytest.mark.parametrize("values,words", [
    ({"loss_scale_init": 0}, "loss_scale_init=0.0 must be a finite number > 0"),
    ({"loss_scale_init": "inf"}, "loss_scale_init=inf"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1 must be a finite number >= 0"),
    ({"threads": -1}, "threads=-1 must be >= 0"),
    ({"temperature": "inf"}, "temperature=inf"),
    ({"max_grad_norm": "nan"}, "max_grad_norm=nan must be a finite number"),
    ({"steps": "inf"}, "steps='inf' is not a valid int"),
    ({"value_clip": "inf"}, "value_clip=inf"),
])
def test_new_refusals(values, words):
    with pytest.raises(ParityError, match=words):
        make_config(values)


@pytest.mark.parametrize("objective", ["ppo-clip", "gspo", "pg-is"])
@pytest.mark.parametrize("scale", [True, False])
def test_a_group_of_one_is_refused_with_group_advantages(objective, scale):
    with pytest.raises(ParityError, match="samples_per_prompt=1.*samples_per_prompt must be >= 2"):
        make_config({"objective": objective, "samples_per_prompt": 1, "scale_rewards": scale})


def test_a_group_of_one_is_fine_with_a_value_head():
    assert make_config({"objective": "ppo-value", "samples_per_prompt": 1}).samples_per_prompt == 1


def test_a_new_config_field_becomes_a_train_flag(monkeypatch, capsys):
    from parity.cli import build_parser

    @dataclasses.dataclass
    class Bigger(Config):
        new_knob: float = config_fields._f(
            0.5, "A field added by this test: it must reach the CLI.", gt=0)
    monkeypatch.setattr(config, "Config", Bigger)
    p = build_parser()
    args = p.parse_args(["train", "--new-knob", "0.7"])
    assert coerce("new_knob", args.new_knob, Bigger) == 0.7
    assert args.new_knob == "0.7"
    with pytest.raises(ParityError, match="new_knob=0.0 must be a finite number > 0"):
        check_fields(dataclasses.replace(Bigger(), new_knob=0.0))
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    want = "--new-knob NEW_KNOB A field added by this test: it must reach the CLI. (default: 0.5)"
    assert want in shown


def test_audit_settings_share_config_fields():
    shared = [n for n in field_specs(AuditSettings) if n in config.FIELDS]
    assert {"engine_dtype", "trainer_dtype", "model", "max_new_tokens", "temperature", "top_p",
            "top_k", "kl_exact_rows", "cpu_fp16", "seed", "progress"} <= set(shared)
    a, c = AuditSettings(), Config()
    hints, chints = typing.get_type_hints(AuditSettings), typing.get_type_hints(Config)
    for name in shared:
        sp, csp = field_specs(AuditSettings)[name], field_specs(Config)[name]
        assert (sp.kind, sp.choices, sp.range) == (csp.kind, csp.choices, csp.range), name
        if name != "task":  # one of three inputs in an audit: None unless given
            assert getattr(a, name) == getattr(c, name), name
            assert hints[name] == chints[name], name
    assert a.kl_exact_rows == Config.kl_exact_rows == 4


@pytest.mark.e2e   # imports TRL, which imports vLLM
def test_parity_options_come_from_config():
    pytest.importorskip("trl")
    from parity.integrations.trl import ParityOptions
    o = ParityOptions()
    assert (o.engine_dtype, o.ratio_source, o.diagnostics, o.trainer_dtype, o.cpu_fp16) == (
        "bf16", "engine", True, None, "emulate")
    for name, sp in field_specs(ParityOptions).items():
        csp = field_specs(Config)[name]
        assert (sp.kind, sp.choices) == (csp.kind, csp.choices), name
        if name not in ("trainer_dtype", "recipe"):  # None: GRPOConfig's; no recipe named
            assert getattr(o, name) == getattr(Config(), name), name
    assert field_specs(ParityOptions)["trainer_dtype"].optional
    for name in ("engine_dtype", "ratio_source", "cpu_fp16", "trainer_dtype"):
        with pytest.raises(ParityError, match=f"^{name}='x' is not one of: "):
            ParityOptions(**{name: "x"}).validate()


# Where a settings class gives one of Config's fields another default or help, on purpose: every
# other default, help, check and type is Config's own.
DELIBERATE = {
    "AuditSettings": {"task": {"default", "help"}, "max_new_tokens": {"help"},
                      "kl_exact_rows": {"help"}},
    "ParityOptions": {"diagnostics": {"help"}, "trainer_dtype": {"default", "help"},
                      "recipe": {"default", "help"}},
    "AsyncParityOptions": {"engine_dtype": {"default", "help"}, "recipe": {"default", "help"},
                           "trainer_dtype": {"default", "help"}, "diagnostics": {"help"},
                           "eps_low": {"default", "help"}, "eps_high": {"default", "help"}},
}


# TRL's classes import TRL, and TRL imports vLLM: seconds the fast tier leaves to the whole suite.
@pytest.mark.parametrize("where", [
    "parity.config:AuditSettings",
    pytest.param("parity.integrations.trl:ParityOptions", marks=pytest.mark.e2e),
    pytest.param("parity.integrations.trl_async:AsyncParityOptions", marks=pytest.mark.e2e)])
def test_settings_fields_are_configs_own(where):
    """A field named as one of Config's has Config's default, help, checks and type (None
    admitted where its default is None), but where DELIBERATE says otherwise. Every field is
    declared in the class's source, where a type checker sees it."""
    module, name = where.split(":")
    if "integrations" in module:
        pytest.importorskip("trl")
    cls = getattr(importlib.import_module(module), name)
    source = inspect.getsource(cls)
    for f in dataclasses.fields(cls):
        assert re.search(rf"^    {f.name}: \S", source, re.M), f"{name}.{f.name} is not declared"
    hints, chints = typing.get_type_hints(cls), typing.get_type_hints(Config)
    shared = [f for f in dataclasses.fields(cls) if f.name in config.FIELDS]
    for f in shared:
        c, why = config.FIELDS[f.name], DELIBERATE[name].get(f.name, set())
        rest = {k: v for k, v in f.metadata.items() if k != "help"}
        assert rest == {k: v for k, v in c.metadata.items() if k != "help"}, f.name
        assert (f.metadata["help"] != c.metadata["help"]) == ("help" in why), f.name
        assert (f.default != c.default) == ("default" in why), f.name
        want = chints[f.name] | None if f.default is None else chints[f.name]
        assert hints[f.name] == want, f.name
    assert set(DELIBERATE[name]) <= {f.name for f in shared}


def test_settings_are_built_by_keyword():
    for cls in (Config, AuditSettings):
        with pytest.raises(TypeError):
            cls("text")


@pytest.mark.parametrize("args,words", [
    (["--max-new-tokens", "0"], "max_new_tokens=0 must be > 0"),
    (["--temperature", "0"], "temperature=0.0 must be a finite number > 0"),
    (["--temperature", "-1"], "temperature=-1.0"),
    (["--temperature", "nan"], "temperature=nan"),
    (["--eps", "1"], "eps=1.0 must be < 1"),
    (["--eps", "0"], "eps=0.0 must be a finite number > 0"),
    (["--samples", "0"], "samples=0 must be > 0"),
    (["--group", "0"], "group=0 must be > 0"),
    (["--group", "1"], "group must be >= 2"),
    (["--batch-size", "0"], "batch_size=0 must be > 0"),
    (["--samples", "many"], "samples='many' is not a valid int"),
    (["--engine-dtype", "int8"], "engine_dtype='int8' is not one of: fp32, bf16, fp16"),
    (["--cpu-fp16", "fast"], "cpu_fp16='fast' is not one of: emulate, native"),
    (["--kl-exact-rows", "-1"], "kl_exact_rows=-1 must be >= 0"),
    (["--task", "neg-length", "--prompts", "p.txt"], "not allowed with argument --task"),
])
def test_bad_audit_settings_are_one_line(tmp_path, capsys, args, words):
    p = run_main("audit", *args, "--out", str(tmp_path / "out"), "--no-progress")
    code, err = p.returncode, p.stderr
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error:") and words in lines[0], err
    assert not (tmp_path / "out").exists()


def test_audit_flags_default_to_the_settings():
    from parity.cli import build_parser
    args = build_parser().parse_args(["audit"])
    for name in field_specs(AuditSettings):
        assert getattr(args, name) is None, name  # not given: AuditSettings' default applies


@pytest.mark.parametrize("args,words", [
    (["--loss-scale-init", "0"], "loss_scale_init=0.0 must be a finite number > 0"),
    (["--weight-decay", "-1"], "weight_decay=-1.0"),
    (["--threads", "-2"], "threads=-2 must be >= 0"),
    (["--max-grad-norm", "inf"], "max_grad_norm=inf must be a finite number"),
    (["--samples-per-prompt", "1"], "samples_per_prompt=1"),
])
def test_train_refuses_before_any_work(tmp_path, capsys, args, words):
    """The default model is not in the test cache: any work would build it and write the run."""
    p = run_main("train", *args, "--out", str(tmp_path / "run"))
    code, err = p.returncode, p.stderr
    assert code == 2 and err.startswith("parity: error:") and words in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
