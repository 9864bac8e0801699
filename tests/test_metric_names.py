"""Metric names are defined once, in parity/metric_names.py: docs/design.md's metrics table is
what its registry renders, every key a run or an audit writes is a registry entry, and no other
module spells a name out."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity import metric_names as mn
from test_readme_tables import table_in

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
TINY = {"model": "text-xs", "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8,
        "threads": 1, "seed": 0, "progress": False, "report_to": "none"}


def test_design_md_table_is_the_rendered_one():
    assert table_in(DESIGN.read_text(), "name") == mn.metrics_table(), (
        "docs/design.md's metrics table is not what parity/metric_names.py renders; paste "
        f"metric_names.metrics_table() over it:\n{mn.metrics_table()}")


def test_a_changed_table_is_found():
    table = table_in(DESIGN.read_text(), "name")
    assert table.replace("`clip/frac`", "`clip/fraction`", 1) != mn.metrics_table()


def test_every_name_is_registered_once_and_every_constant_is_registered():
    names = [m.name for m in mn.REGISTRY]
    assert len(names) == len(set(names))
    # CLIP is a prefix; PHANTOM_AT_EPS names an audit sweep's row for advice.py, in no file
    constants = {v for k, v in vars(mn).items() if k.isupper() and isinstance(v, str)
                 and k not in ("CLIP", "PHANTOM_AT_EPS") and ("/" in v or v == mn.STEP)}
    assert constants == set(names)


def test_families_match_by_pattern_and_only_their_names():
    assert mn.entry("beta_by_prob/0.1-0.5/abs_mean").name == mn.BETA_BY_PROB
    assert mn.entry("beta_by_pos/512+/tokens").name == mn.BETA_BY_POS
    assert mn.entry("rewards/format/mean").name == mn.REWARD_FN_MEAN
    assert mn.entry(mn.BETA_ABS_MEAN).name == mn.BETA_ABS_MEAN
    for key in ("mismatch/beta", "beta_by_prob/0-0.1/mean/x", "rewards//mean", "toy/tokens"):
        assert mn.entry(key) is None, key


def test_no_other_module_spells_a_name_out():
    """A name as a whole string literal anywhere in parity but metric_names.py would be a
    second definition. `step` is also a column and a checkpoint field, so it is left out."""
    exact = {m.name for m in mn.REGISTRY if "{" not in m.name} - {mn.STEP}
    found = []
    for p in (ROOT / "parity").rglob("*.py"):
        if p.name == "metric_names.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value in exact:
                found.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not found, found


def test_metric_names_imports_without_torch():
    code = "import sys, parity.metric_names; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.stdout.strip() == "False", p.stderr


def _unregistered(keys) -> set[str]:
    return {k for k in keys if mn.entry(k) is None}


@pytest.mark.e2e
def test_every_key_a_run_and_an_audit_write_is_registered(tmp_path, text_model):
    from parity.audit.command import audit
    from parity.config import AuditSettings, make_config
    from parity.trainer import train
    out = train(make_config({**TINY, "steps": 2, "diagnostics": True, "kl_exact_rows": 2,
                             "out": str(tmp_path / "run")}))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # written at every step of every run: the registry says so of these
    always = {m.name for m in mn.REGISTRY if not m.absent}
    for row in rows:
        assert not _unregistered(row), _unregistered(row)
        assert always <= row.keys(), always - row.keys()
    res = audit(AuditSettings(model="text-xs", task="neg-length", samples=16, group=4,
                              max_new_tokens=8, kl_exact_rows=2, progress=False, device="cpu"),
                tmp_path / "audit", report=False)
    assert mn.LOG_RATIO_ABS_MEAN in res["metrics"]
    assert not _unregistered(res["metrics"]), _unregistered(res["metrics"])


def test_the_other_frameworks_table_is_the_rendered_one():
    doc = (ROOT / "docs" / "diagnostics.md").read_text()
    assert table_in(doc, "parity") == mn.elsewhere_table(), (
        "docs/diagnostics.md's table of other frameworks' names is not what "
        f"metric_names.elsewhere_table() renders:\n{mn.elsewhere_table()}")
    assert all(mn.entry(e.name) is not None for e in mn.ELSEWHERE)


def test_the_verl_docs_name_verls_own_metric_beside_parity_s():
    """docs/verl.md's table of the plugin's figures gives verl's name for each quantity the
    registry says verl logs too."""
    rows = [line for line in (ROOT / "docs" / "verl.md").read_text().splitlines()
            if line.startswith("| `parity/")]
    for e in mn.ELSEWHERE:
        if e.verl != "—" and e.name != mn.CLIP_FRAC and not e.name.startswith("is/"):
            assert any(e.name.rsplit("/", 1)[-1] in r and e.verl in r for r in rows), e
