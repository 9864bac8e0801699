"""The audit's advice: the recommended recipe from hand-built figures, the fp16 check it reads,
and the reference points it ships, which are the committed audits' own figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.audit import advice
from parity.errors import ParityError

ROOT = Path(__file__).resolve().parents[1]


def _result(phantom: float, gap: float, alpha: float, pdiff: float, eps: float = 0.2,
            engine_dtype: str = "bf16") -> dict:
    return {"model": "mine", "eps": eps, "engine_dtype": engine_dtype,
            "metrics": {"clip/phantom_frac": phantom, "mismatch/log_ratio_abs_mean": gap,
                        "mismatch/alpha_abs_mean": alpha, "mismatch/prob_diff_abs_mean": pdiff,
                        "mismatch/kl_k3": 1e-3},
            "phantom_vs_eps": [{"eps": 0.05, "phantom_frac": 0.3},
                               {"eps": eps, "phantom_frac": phantom}]}


def _check(tmp_path: Path, inference: str, training: str) -> str:
    p = _mkdir(tmp_path) / "fp16_check.json"
    p.write_text(json.dumps({"verdict": {"inference": inference, "training": training}}))
    return str(tmp_path)


def test_below_one_percent_phantom_no_fix_is_recommended():
    a = advice.advise(_result(phantom=0.0099, gap=0.04, alpha=0.04, pdiff=0.02))
    assert a.status == "fine" and a.recipe is None
    assert "0.99%" in a.headline and "no fix needed" in a.headline


def test_a_shadow_that_reproduces_the_engine_is_recommended():
    # |α| at 10% of the gap is the limit; 0.1·0.04 = 0.004
    a = advice.advise(_result(phantom=0.05, gap=0.04, alpha=0.004, pdiff=0.004))
    assert a.status == "fix" and a.recipe == "bf16-shadow"
    assert "--recipe bf16-shadow" in a.headline and "5.00%" in a.headline


def test_a_shadow_with_other_kernels_is_not_recommended():
    """Against vLLM the shadow's kernel gap is as large as the gap itself (docs/vllm.md): the
    trainer's own recomputed log-probs take β out instead, with a truncated importance weight
    where verl's guidance calls the gap a precision problem."""
    a = advice.advise(_result(phantom=0.05, gap=0.04, alpha=0.0041, pdiff=0.006))
    assert a.recipe == "recompute"
    shadow = next(o for o in a.options if o["fix"] == "bf16-shadow")
    assert shadow["fits"] == "no"
    a = advice.advise(_result(phantom=0.05, gap=0.04, alpha=0.05, pdiff=0.0101))
    assert a.recipe == "tis"
    assert any("an engine precision problem" in r for r in a.reasons)


@pytest.mark.parametrize("pdiff, word", [(0.0049, "normal"), (0.0075, "between normal"),
                                         (0.011, "an engine precision problem")])
def test_verls_thresholds(pdiff, word):
    a = advice.advise(_result(phantom=0.0, gap=0.01, alpha=1e-7, pdiff=pdiff))
    assert any(f"{pdiff:.3g} per token: {word}" in r for r in a.reasons), a.reasons


def test_the_fp16_check_decides_whether_fp16_fits(tmp_path):
    ok = advice.advise(_result(0.05, 0.04, 0.05, 0.006), _check(tmp_path / "a", "OK", "OK"))
    assert "or fp16, which the model fits" in ok.headline
    assert next(o for o in ok.options if o["fix"] == "fp16")["fits"] == "yes"
    bad = advice.advise(_result(0.05, 0.04, 0.05, 0.006),
                        _check(tmp_path / "b", "OK", "UNDERFLOW-RISK"))
    assert "fp16" not in bad.headline
    assert next(o for o in bad.options if o["fix"] == "fp16")["fits"] == "no"
    unknown = advice.advise(_result(0.05, 0.04, 0.05, 0.006))
    assert next(o for o in unknown.options if o["fix"] == "fp16")["fits"] == "unknown"
    assert any("parity fp16-check" in r for r in unknown.reasons)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@pytest.mark.parametrize("content, words", [
    ("{not json", ["fp16_check.json"]),
    ('{"verdict": {"inference": "OK"}}', ["not a `parity fp16-check` result"]),
    ("[1, 2]", ["not a `parity fp16-check` result"])])
def test_a_bad_fp16_check_is_one_line(tmp_path, content, words):
    (_mkdir(tmp_path) / "fp16_check.json").write_text(content)
    with pytest.raises(ParityError) as e:
        advice.fp16_fit(str(tmp_path / "fp16_check.json"))
    for w in words:
        assert w in str(e.value)


@pytest.mark.e2e
def test_reference_points_are_the_committed_audits():
    """The shipped reference rows are what scripts/reference_points.py reads from the committed
    audits, figure for figure; the script's check fails on a file that differs."""
    r = subprocess.run([sys.executable, "scripts/reference_points.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(x["model"], x["label"]): x for x in advice.reference_points("smollm2-135m")
            if "source" in x and x["source"].startswith("docs/") and "values" in x}
    live = json.loads((ROOT / "docs/data/live-server-audit.json").read_text())
    bf16 = next(x for x in live["rows"] if x["server_dtype"] == "bf16")
    mine = rows[("smollm2-135m", "vLLM bf16 (CPU build, server)")]["values"]
    assert mine["mismatch/log_ratio_abs_mean"] == bf16["log_ratio_abs_mean"]
    assert mine["clip/phantom_frac@0.2"] == bf16["phantom_frac"]
    own = json.loads((ROOT / "docs/reproduce/smollm2-135m/audits/fp16/audit.json").read_text())
    v = rows[("smollm2-135m", "parity's engine, fp16")]["values"]
    assert v["mismatch/kl_k3"] == own["metrics"]["mismatch/kl_k3"]


def test_the_reference_table_puts_the_users_figures_first():
    res = _result(phantom=0.02, gap=0.04, alpha=0.05, pdiff=0.006)
    res["model"] = "smollm2-135m"
    res["advice"] = advice.as_json(advice.advise(res))
    w = advice.what_to_do(res)
    title, head, rows, _ = w["tables"][0]
    assert rows[0][:3] == ["your audit", "smollm2-135m", "0.04"]
    assert rows[0][head.index("phantom-clipped at ε=0.05")] == "30.00%"
    labels = [r[0] for r in rows]
    assert "vLLM fp16 (CPU build, server)" in labels and "parity's engine, bf16" in labels
    assert any(lab.startswith("seeds:") for lab in labels)
    # every metric name shown for parity is one parity writes (docs/design.md, Metrics)
    design = (ROOT / "docs/design.md").read_text()
    for n in advice.METRIC_NAMES:
        assert f"`{n['parity']}`" in design, n["parity"]
