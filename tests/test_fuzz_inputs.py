"""Generated input for the config and the file readers: each either succeeds or raises
ParityError with a one-line message, never another exception (docs/errors.md, "Generated
input"). Derandomized, so every run tries the same inputs: about 1,300 of them in process, and
5 through `python -m parity`; the counts keep the file under a minute on two cores."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cli_helpers import assert_user_error, run_main
from parity.audit.inputs import read_prompts, read_rollouts
from parity.config import AuditSettings, Config, coerce, field_specs, load_yaml, make_config
from parity.errors import ParityError
from parity.reports import load_metrics
from parity.tasks import load_rows


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def refused_or_ok(fn, *args):
    """fn(*args), or None when it refuses; a refusal must be one non-empty line."""
    try:
        return fn(*args)
    except ParityError as e:
        msg = str(e)
        assert msg.strip() and msg == " ".join(msg.splitlines()), repr(msg)
        return None


FIELDS = list(field_specs(Config))
AUDIT_FIELDS = list(field_specs(AuditSettings))
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-10**30, max_value=10**30),
    st.sampled_from([0, -1, 1, 2, 2**63, -2**63, 10**400, 1e308, 5e-324, 3.4e38, 1e39, -1e39]))
TEXTS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-3", "0", "1.5", "ten", "", "none", "null",
                     "true", "off", "0x10", "1_000", " 7 ", "fp16", "ppo-clip", "1,2", "auto"]),
    st.text(max_size=20))
SCALARS = st.one_of(NUMBERS, TEXTS, st.booleans(), st.none())
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3),
                   st.dictionaries(st.text(max_size=5), SCALARS, max_size=2))
CONFIGS = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), VALUES,
                          max_size=6)


# ---- the config: values, flags, YAML --------------------------------------------------------

@fuzz(250)
@given(CONFIGS)
def test_make_config_refuses_in_one_line_or_builds(explicit):
    cfg = refused_or_ok(make_config, explicit)
    if cfg is not None:  # what it accepted passes its own checks again
        assert make_config(cfg.to_dict()).to_dict() == cfg.to_dict()


@fuzz(250)
@given(st.sampled_from(FIELDS + AUDIT_FIELDS), VALUES)
def test_coerce_refuses_in_one_line_or_converts(name, value):
    cls = Config if name in FIELDS else AuditSettings
    v = refused_or_ok(coerce, name, value, cls)
    if v is not None and field_specs(cls)[name].kind is float:
        assert isinstance(v, float)


@fuzz(100)
@given(st.dictionaries(st.sampled_from(AUDIT_FIELDS), VALUES, max_size=5))
def test_audit_settings_refuse_in_one_line_or_validate(given_values):
    def build():
        values = {k: coerce(k, v, AuditSettings) for k, v in given_values.items()}
        return AuditSettings(**values).validate()
    refused_or_ok(build)


YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.integers()),
                                            inner, max_size=3)),
    max_leaves=8)
YAML_DOCS = st.one_of(
    st.builds(yaml.safe_dump, YAML_VALUES),
    st.builds(yaml.safe_dump, st.dictionaries(st.sampled_from(FIELDS), YAML_VALUES, max_size=5)),
    st.text(max_size=60))


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="parity-fuzz-") as d:
        yield Path(d)


@fuzz(120)
@given(doc=YAML_DOCS)
def test_yaml_documents_refused_in_one_line_or_read(scratch, doc):
    path = scratch / "c.yaml"
    path.write_text(doc, encoding="utf-8")
    data = refused_or_ok(load_yaml, path)
    if data is not None:
        refused_or_ok(make_config, data)


# ---- the file readers ------------------------------------------------------------------------

def _write(path: Path, content: bytes | str) -> Path:
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    return path


# Bytes: random ones, and text with a stray byte, a NUL or a BOM, which most readers meet.
BYTES = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda a, b, c: a.encode() + b + c.encode(), st.text(max_size=20),
              st.sampled_from([b"\xff", b"\xe9", b"\x00", b"\xef\xbb\xbf", b"\r\n", b"\x80\x80"]),
              st.text(max_size=20)))


@fuzz(200)
@given(data=BYTES, suffix=st.sampled_from([".yaml", ".jsonl", ".json", ".parquet", ".txt"]))
def test_random_bytes_refused_in_one_line_by_every_reader(scratch, data, suffix):
    path = _write(scratch / f"f{suffix}", data)
    readers = {".yaml": [load_yaml], ".txt": [read_prompts],
               ".jsonl": [load_rows, read_prompts, load_metrics,
                          lambda p: read_rollouts(p, 512)],
               ".json": [load_rows, lambda p: read_rollouts(p, 512)],
               ".parquet": [load_rows, lambda p: read_rollouts(p, 512)]}[suffix]
    for read in readers:
        refused_or_ok(read, str(path))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(min_value=-2**70,
                                                                   max_value=2**70),
              st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
MESSAGES = st.lists(st.dictionaries(st.sampled_from(["role", "content"]), JSON_VALUES,
                                    max_size=2), max_size=2)
DATASET_ROWS = st.lists(st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=10), MESSAGES, JSON_VALUES)},
                          optional={"answer": JSON_VALUES}),
    JSON_VALUES), max_size=4)


@fuzz(150)
@given(rows=DATASET_ROWS, form=st.sampled_from(["jsonl", "json", "parquet"]))
def test_dataset_rows_refused_in_one_line_or_read(scratch, rows, form):
    path = scratch / f"d.{form}"
    if form == "parquet":
        try:
            pq.write_table(pa.Table.from_pylist([r for r in rows if isinstance(r, dict)]), path)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            assume(False)  # rows pyarrow cannot type are no parquet file to read
    else:
        lines = [json.dumps(r) for r in rows]
        _write(path, "[" + ",\n".join(lines) + "]" if form == "json" else "\n".join(lines))
    got = refused_or_ok(load_rows, str(path))
    if got is not None:
        assert got and all("prompt" in r for r in got)
    if form != "json":
        refused_or_ok(read_prompts, str(path))


TOKEN_IDS = st.one_of(st.lists(st.integers(min_value=-5, max_value=600), max_size=4),
                      st.lists(st.sampled_from([2**63, 10**30, -(10**30), 10**400]), min_size=1,
                               max_size=2))
LOGPROBS = st.one_of(st.lists(st.floats(), max_size=4),
                     st.lists(st.sampled_from([-1e39, 1e39, -(10**40), -(10**400), 0.5, -0.0]),
                              min_size=1, max_size=3))


# Values every check must meet: beyond float64 or float32, not numbers, not finite.
EDGES = st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400), 1e39, -1e39, 2**63,
                         -1, 0.5, "x", None, True, [], {}])


@st.composite
def rollout_rows(draw) -> dict:
    """A valid row, then some of its values replaced by edge values: a random row would fail
    its first check and never reach the later ones."""
    n = draw(st.integers(1, 4))
    row = {"prompt_token_ids": draw(st.lists(st.integers(0, 511), min_size=1, max_size=4)),
           "completion_token_ids": draw(st.lists(st.integers(0, 511), min_size=n, max_size=n)),
           "engine_logprobs": draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n))}
    what = draw(st.sampled_from(["none", "logprob", "token", "field", "advantage", "reward"]))
    if what in ("advantage", "reward"):
        row[what] = draw(st.one_of(EDGES, NUMBERS))
    elif what == "logprob":  # the length kept, so the value itself is what is checked
        row["engine_logprobs"][draw(st.integers(0, n - 1))] = draw(st.one_of(EDGES, NUMBERS))
    elif what == "token":
        row["completion_token_ids"][draw(st.integers(0, n - 1))] = draw(EDGES)
    elif what == "field":
        row[draw(st.sampled_from(sorted(row)))] = draw(st.one_of(TOKEN_IDS, LOGPROBS, EDGES,
                                                                  JSON_VALUES))
    return row


ROLLOUT_ROWS = st.one_of(st.lists(rollout_rows(), min_size=1, max_size=2),
                         st.lists(JSON_VALUES, max_size=2).map(lambda v: v + [{}]))


@fuzz(150)
@given(rows=ROLLOUT_ROWS)
def test_rollout_rows_refused_in_one_line_or_read(scratch, rows):
    path = _write(scratch / "r.jsonl", "\n".join(json.dumps(r) for r in rows))
    got = refused_or_ok(read_rollouts, str(path), 512)
    for r in got or []:   # a NaN or inf is read, to be left out of the figures and counted
        assert all(isinstance(v, float) or math.isfinite(v) for v in r["engine_logprobs"])


@fuzz(80)
@given(rows=st.lists(st.one_of(st.fixed_dictionaries({"step": st.one_of(NUMBERS, JSON_VALUES)},
                                                     optional={"reward/mean": JSON_VALUES}),
                               JSON_VALUES), max_size=4))
def test_metrics_rows_refused_in_one_line_or_read(scratch, rows):
    path = _write(scratch / "metrics.jsonl", "\n".join(json.dumps(r) for r in rows))
    for r in refused_or_ok(load_metrics, path) or []:
        assert math.isfinite(r["step"])


# ---- through the command line ----------------------------------------------------------------

BAD_NUMBERS = st.one_of(st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e400", "ten", ""]),
                        st.floats(max_value=0).map(repr))
CLI_CASES = st.one_of(
    st.tuples(st.just("--lr"), BAD_NUMBERS),
    st.tuples(st.just("--temperature"), BAD_NUMBERS),
    st.tuples(st.just("--steps"), st.one_of(BAD_NUMBERS, st.floats(0.1, 9.9).filter(
        lambda x: x != int(x)).map(repr))),
    st.tuples(st.just("--config"), st.binary(max_size=30).map(lambda b: b"\xff" + b)))


@pytest.mark.e2e
@fuzz(5)
@given(case=CLI_CASES)
def test_generated_bad_input_through_the_command_line(scratch, case):
    flag, value = case
    if flag == "--config":
        value = str(_write(scratch / "cli.yaml", value))
    out = scratch / "cli-run"
    p = run_main("train", f"{flag}={value}", "--out", str(out))
    assert_user_error(p)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()
