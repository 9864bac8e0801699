"""The benches' shared parts: the timing helper's statistics, the table writer, and the docs'
tables, which must be what bench/tables.py renders from the committed JSON files."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
HELPERS = {"__init__", "timing", "report", "tables", "memory_sites"}


from bench import longest, report, tables, timing, vs_trl  # noqa: E402  (pyproject's pythonpath: the root)


class FakeClock:
    """A clock that only moves when a timed call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def cost(self, seconds: float):
        def fn():
            self.now += seconds
            return seconds
        return fn


def test_measure_times_each_repeat_and_not_the_warmup():
    clock = FakeClock()
    costs = iter([100.0, 3.0, 1.0, 2.0, 10.0, 4.0])   # the first is the warm-up's

    def call():
        c = next(costs)
        clock.now += c
        return c
    t = timing.measure(call, warmup=1, repeats=5, clock=clock)
    assert t.samples == (3.0, 1.0, 2.0, 10.0, 4.0)
    assert t.results == (3.0, 1.0, 2.0, 10.0, 4.0)
    assert t.median == 3.0 and t.min == 1.0 and t.max == 10.0 and t.mean == 4.0
    assert t.spread == pytest.approx(9.0 / 3.0)


def test_measure_keeps_setup_out_of_the_timed_span():
    clock = FakeClock()
    setups = []

    def setup():
        clock.now += 50.0          # a prefill: not part of what is timed
        setups.append(clock.now)
        return 2.0

    def call(seconds):
        clock.now += seconds
        return seconds
    t = timing.measure(call, setup=setup, warmup=2, repeats=3, clock=clock)
    assert t.samples == (2.0, 2.0, 2.0)
    assert len(setups) == 5       # once before each call, warm-ups included


def test_measure_on_a_known_cost():
    t = timing.measure(lambda: time.sleep(0.02), warmup=0, repeats=3)
    assert len(t.samples) == 3
    assert t.min >= 0.02           # perf_counter never runs slower than a sleep
    assert t.median < 2.0


def test_measure_refuses_zero_repeats():
    with pytest.raises(ValueError):
        timing.measure(lambda: None, repeats=0)


def test_alternate_interleaves_the_calls_round_by_round():
    clock, order = FakeClock(), []

    def call(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn
    t = timing.alternate({"a": call("a", 1.0), "b": call("b", 5.0)}, warmup=1, repeats=3,
                         clock=clock)
    assert order == ["a", "b"] * 4
    assert t["a"].samples == (1.0, 1.0, 1.0) and t["b"].samples == (5.0, 5.0, 5.0)
    assert t["b"].median / t["a"].median == 5.0


def test_a_table_renders_its_values_through_its_formats():
    t = report.Table("t", "a title", [("name", None), ("seconds", "{:.2f}"), ("share", "{:.1%}"),
                                      ("ratio", "{:.2f}x"), ("same", None), ("a|b", None)])
    t.add("x", 1.234, 0.5, 2.0, True, "p|q")
    t.add("y", None, 0.25, 3.0, False, "r")
    assert t.markdown().splitlines() == [
        "| name | seconds | share | ratio | same | a\\|b |",
        "|---|---:|---:|---:|---|---|",
        "| x | 1.23 | 50.0% | 2.00x | yes | p\\|q |",
        "| y | — | 25.0% | 3.00x | no | r |"]
    assert report.Table.from_json(json.loads(json.dumps(t.to_json()))).text() == t.text()
    with pytest.raises(ValueError):
        t.add("too few")


def test_publish_prints_and_writes_the_same_table(tmp_path, capsys):
    import argparse
    t = report.Table("main", "title", [("k", None), ("v", "{:.3f}")])
    t.add("a", 0.12345)
    args = argparse.Namespace(model="m", json=str(tmp_path / "x.json"))
    report.publish("demo", [t], args)
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["bench"] == "demo" and data["settings"] == {"model": "m"}
    assert data["tables"][0]["rows"] == [["a", 0.12345]]
    assert data["command"].startswith("python ")
    assert {"torch", "torch_threads", "device", "cores"} <= set(data["machine"])
    assert "| a | 0.123 |" in capsys.readouterr().out


def test_json_option_defaults_to_the_benchs_file_and_empty_writes_nothing(tmp_path):
    import argparse
    ap = report.json_option(argparse.ArgumentParser(), "demo")
    assert Path(ap.parse_args([]).json) == ROOT / "docs" / "data" / "bench" / "demo.json"
    t = report.Table("main", "", [("k", None)])
    assert report.publish("demo", [t], ap.parse_args(["--json", ""])) is None


def benches() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if p.stem not in HELPERS)


def test_every_bench_writes_its_tables_and_patches_no_path():
    for p in benches():
        src = p.read_text()
        names = {n.attr if isinstance(n, ast.Attribute) else n.id
                 for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Name, ast.Attribute))}
        assert {"json_option", "publish"} <= names, f"{p.name} does not report through report.py"
        assert "sys.path" not in src, f"{p.name} patches sys.path"
        assert not [line for line in src.splitlines()
                    if line.startswith(("from report ", "from timing ", "import report"))], \
            f"{p.name} imports a helper by its bare name, not from the bench package"


def test_the_docs_tables_are_what_their_json_renders():
    marked = 0
    for doc in tables.docs():
        text = doc.read_text()
        marked += len(tables.regions(text))
        assert tables.rewrite(text, doc) == text, \
            f"{doc.relative_to(ROOT)}: a marked table differs; run python -m bench.tables"
    assert marked > 0


def test_a_changed_figure_in_a_marked_table_is_caught():
    doc = next(d for d in tables.docs() if tables.regions(d.read_text()))
    text = doc.read_text()
    start = text.index("<!-- bench: ")
    row = text.index("\n| ", text.index("|---", start)) + 1   # the first row of its table
    cell = text.index(" | ", row) + 3
    changed = text[:cell] + "9" + text[cell:]
    assert tables.rewrite(changed, doc) == text


def test_every_committed_bench_file_renders():
    files = sorted((ROOT / "docs" / "data" / "bench").glob("*.json"))
    assert files
    for f in files:
        data = json.loads(f.read_text())
        assert {"bench", "command", "date", "tables"} <= set(data), f.name
        assert (BENCH / f"{data['bench']}.py").exists(), f.name
        for t in data["tables"]:
            table = report.Table.from_json(t)
            assert all(len(r) == len(table.columns) for r in table.rows), f.name
            table.text()


def test_memory_sites_replay_the_history_to_its_peak():
    """By hand: 100 bytes alive before recording (freed at event 3), then a 50-byte block from
    the optimizer, a 200-byte one from a layer, the old block freed, its address reused for 30
    bytes: the peak is 350 bytes after event 2 (100 + 50 + 200), and the sites alive then are
    the unrecorded block, the layer and the optimizer."""
    from bench.memory_sites import sites_at_peak

    def frames(*where):
        return [{"filename": f, "line": n, "name": fn} for f, n, fn in where]
    layer = frames(("/x/site-packages/torch/nn/functional.py", 1, "linear"),
                   ("/x/site-packages/transformers/models/qwen3/modeling_qwen3.py", 7, "forward"),
                   ("/work/parity/models/forward.py", 85, "score_full"))
    adam = frames(("/x/site-packages/torch/optim/adamw.py", 3, "step"),
                  ("/work/parity/models/precision.py", 158, "step"))
    events = [{"action": "alloc", "addr": 2, "size": 50, "frames": adam},
              {"action": "alloc", "addr": 3, "size": 200, "frames": layer},
              {"action": "free_completed", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 1, "size": 30, "frames": adam},
              {"action": "free_completed", "addr": 3, "size": 200}]
    snap = {"device_traces": [events],
            "segments": [{"blocks": [{"address": 1, "size": 30, "state": "active_allocated"},
                                     {"address": 2, "size": 50, "state": "active_allocated"},
                                     {"address": 9, "size": 7, "state": "inactive"}]}]}
    got = sites_at_peak(snap, 0, top=2)
    assert got["peak_gib"] * 2**30 == 350
    rows = [(r["site"], r["via"], r["gib"] * 2**30, r["blocks"]) for r in got["rows"]]
    assert rows == [("transformers/models/qwen3/modeling_qwen3.py:7 forward",
                     "parity/models/forward.py:85 score_full", 200, 1),
                    ("allocated before recording", "", 100, 1)]
    assert got["rest_gib"] * 2**30 == 50   # the optimizer's block, below the top 2


@pytest.mark.e2e
@pytest.mark.budget(45)
def test_the_vocabulary_bench_prices_each_setting_in_its_own_process(tmp_path):
    """`bench/vocab_step.py` at a tiny size: every setting runs (each in a fresh process), the
    table has the default step, its three comparisons and their shares, and the shares are what
    the step times say."""
    out = tmp_path / "v.json"
    subprocess.run([sys.executable, "-m", "bench.vocab_step", "--model", "text-xs", "--steps",
                    "2", "--rounds", "1", "--prompts", "2", "--group", "2", "--max-new-tokens",
                    "6", "--verl-rows", "8", "--verl-tokens", "16", "--verl-repeats", "1",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, text=True)
    table = json.loads(out.read_text())["tables"][0]
    rows = {r[1]: r for r in table["rows"]}
    assert list(rows) == ["default diagnostics", "kl_exact_rows 0", "diagnostics off",
                          "sampling alone"]
    step = {name: r[5] for name, r in rows.items()}
    full = step["default diagnostics"]
    assert full > 0 and rows["default diagnostics"][6] is None
    for name in ("kl_exact_rows 0", "diagnostics off"):
        assert rows[name][6] == pytest.approx((full - step[name]) / full)
    assert rows["sampling alone"][6] == pytest.approx(rows["diagnostics off"][3] / full)


def test_a_parity_variant_sets_config_fields_over_the_benchs_workload(tmp_path, monkeypatch,
                                                                     capsys):
    """`--parity RECIPE:FLAG:KEY=VALUE`: the recipe, its flags, and fields set last; a mistyped
    flag or field is refused before any run."""
    assert vs_trl.parse_variant("bf16-shadow:scored:logprob_chunk=2:micro_batch=4") == (
        "bf16-shadow", ["scored"], {"logprob_chunk": "2", "micro_batch": "4"})
    with pytest.raises(ValueError, match="scorde"):
        vs_trl.parse_variant("bf16-shadow:scorde")
    a = vs_trl.parser().parse_args(["--task", "neg-length", "--model", "text-xs",
                                    "--micro-batch", "2", "--variant",
                                    "fp32:logprob_chunk=2:micro_batch=1"])
    cfg = vs_trl.parity_config(a, tmp_path)
    assert (cfg.recipe, cfg.logprob_chunk, cfg.micro_batch, cfg.lr) == ("fp32", 2, 1, 3e-4)
    # in this process: the refusal is argparse's, before any worker or model
    monkeypatch.setattr(sys, "argv", ["vs_trl", "--parity", "fp32,fp32:logprob_chunkk=2",
                                      "--json", ""])
    with pytest.raises(SystemExit) as stop:
        vs_trl.main()
    out = capsys.readouterr()
    assert stop.value.code == 2 and "logprob_chunkk" in out.err and "run 1" not in out.out


def test_the_longest_fit_takes_a_curvature_only_where_the_growth_speeds_up():
    ts = [512, 1024, 2048]
    line = [1 + 0.002 * t for t in ts]
    assert longest.fit(ts, line) == pytest.approx((1, 0.002, 0))
    assert longest.reach(longest.fit(ts, line), 21) == pytest.approx(10_000)
    curved = [1 + 0.002 * t + 1e-6 * t * t for t in ts]
    assert longest.fit(ts, curved) == pytest.approx((1, 0.002, 1e-6))
    noisy = [1.0, 2.1, 4.0]   # the middle peak 0.1 high: slopes 2.1e-3 and 1.9e-3 per token
    assert longest.fit(ts, noisy)[2] == 0
    assert longest.reach((30, 0.002, 0), 21) == 0 and longest.reach((1, -1, 0), 21) == math.inf


def _rows(table: dict) -> dict[str, dict]:
    cols = [c["name"] for c in table["columns"]]
    return {r[0]: dict(zip(cols, r)) for r in table["rows"]}


@pytest.mark.e2e
@pytest.mark.budget(90)
def test_vs_trl_puts_parity_before_and_after_beside_trl(tmp_path):
    """bench/vs_trl.py at a tiny size with ParityGRPOTrainer in TRL's place and a parity side
    that sets a config field: a row per side, in the order named, each with
    finite step time, update-alone time and peak resident memory; parity's figures for every
    parity side, and the GRPOConfig change ParityGRPOTrainer announced for its recipe."""
    out = tmp_path / "v.json"
    subprocess.run([sys.executable, "-m", "bench.vs_trl", "--model", "text-xs", "--task",
                    "neg-length", "--prompts", "1", "--group", "2", "--max-new-tokens", "4",
                    "--steps", "1", "--repeats", "1", "--trl-parity", "bf16",
                    "--parity", "fp32:logprob_chunk=2",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, text=True)
    tables = {t["name"]: t for t in json.loads(out.read_text())["tables"]}
    rows = _rows(tables["vs_trl"])
    parity_sides = ["trl-parity bf16", "parity-hf fp32:logprob_chunk=2"]
    assert list(rows) == ["trl", *parity_sides]
    for r in rows.values():
        assert all(math.isfinite(r[c]) and r[c] > 0 for c in ("step_s", "update alone s",
                                                               "peak_gb")), r
    figures = _rows(tables["vs_trl_figures"])
    assert list(figures) == parity_sides
    assert all(0 <= f["clip/frac"] <= 1 and f["mismatch/beta_abs_mean"] >= 0
               for f in figures.values()), figures
    assert tables["vs_trl_figures"]["notes"] == [
        "trl-parity bf16, what ParityGRPOTrainer changed: GRPOConfig bf16=False set to True: "
        "recipe bf16 trains in bf16"]


@pytest.mark.e2e
@pytest.mark.budget(120)
def test_the_longest_completion_probe_fits_each_side_and_checks_its_prediction(tmp_path):
    """bench/longest.py at a tiny size: each side's trials, a fit with a finite growth per token,
    a longest length within the model's context (text-xs: 256 positions), and the run that
    checks it."""
    out = tmp_path / "l.json"
    subprocess.run([sys.executable, "-m", "bench.longest", "--model", "text-xs", "--lengths",
                    "4,8", "--parity", "fp32", "--json", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    tables = {t["name"]: t for t in json.loads(out.read_text())["tables"]}
    rows = _rows(tables["longest"])
    assert list(rows) == ["trl", "parity-hf fp32"]
    for r in rows.values():
        assert math.isfinite(r["MiB per token"]) and 0 < r["longest T"] < 256, r
        assert r["verify"] == "ran" and 0 < r["verified peak GiB"] < 21, r
    trials = tables["longest_trials"]["rows"]
    assert [(r[0], r[1]) for r in trials] == [(s, t) for s in rows for t in (4, 8)]
    assert all(math.isfinite(r[2]) and r[5] is None for r in trials)
