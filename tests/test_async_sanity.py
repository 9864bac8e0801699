"""scripts/async_sanity.py: which runs an invocation still has to run, and verdicts and
tables that follow the numbers kept (no server is started here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("async_sanity", ROOT / "scripts/async_sanity.py")
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)


def _args(**kw) -> argparse.Namespace:
    base = dict(model="smollm2-135m", steps=3, seeds=[0, 1, 2], batch=8, group=4,
                max_tokens=64, server_cpus=None, trainer_cpus=None, only=None)
    return argparse.Namespace(**{**base, **kw})


def _keep(out: Path, a, name: str, seed: int, **extra) -> None:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{name}-s{seed}.json").write_text(json.dumps(
        {"recipe": name, "seed": seed, "settings": S._settings(a), "wall_s": 1.0,
         "steps": [], **extra}))


def test_a_rerun_runs_only_what_is_not_kept_with_the_same_settings(tmp_path):
    a = _args()
    names = [(j[1], j[4]) for j in S.planned(a)]
    # the first three recipes on every seed, the others on the first seed only
    assert names.count(("bf16-engine", 2)) == 1 and ("bf16-shadow", 1) not in names
    assert len(names) == 3 * 3 + 4
    _keep(tmp_path, a, "bf16-engine", 0)
    _keep(tmp_path, a, "fp32", 1, failed="boom")           # a failure is tried again
    _keep(tmp_path, _args(steps=20), "fp16", 0)             # other settings: not reused
    todo = [(j[1], j[4]) for j in S.pending(a, tmp_path)]
    assert ("bf16-engine", 0) not in todo and ("fp32", 1) in todo and ("fp16", 0) in todo
    assert len(todo) == len(names) - 1
    only = [(j[1], j[4]) for j in S.pending(_args(only=["fp16"]), tmp_path)]
    assert only == [("fp16", 0), ("fp16", 1), ("fp16", 2)]
    # nothing pending: the kept runs come back in plan order and no server is started
    for name, seed in names:
        _keep(tmp_path, a, name, seed)
    runs = S.run_all(a, tmp_path / "no-such-model", tmp_path)
    assert [(r["recipe"], r["seed"]) for r in runs] == names


def _row(recipe, seed=0, first=30.0, last=30.0, **kw):
    return {"recipe": recipe, "seed": seed, "length_first": first, "length_last": last, **kw}


def test_claims_follow_the_numbers():
    rows = [_row("bf16-engine", beta_abs=0.05, phantom=0.001, clip_first=0.002, probe_gap=0.08),
            _row("fp16", beta_abs=0.005), _row("fp32"),
            _row("bf16-shadow", alpha_first=0.08, shadow_s=2.0),
            _row("bf16-shadow-scored", alpha_first=0.001, shadow_s=3.0)]
    by = {c[0]: c for c in S.claims(rows, steps=3)}
    assert "not measurable here" in by["A1"][3]            # one seed, three steps
    assert "does not hold" in by["A2"][3] and "0.20% clipped at step 1" in by["A2"][2]
    rows[0]["clip_first"] = 0.15                           # within a factor 3 of 18%
    assert "holds" in {c[0]: c for c in S.claims(rows, 3)}["A2"][3]
    rows[0]["clip_first"] = 0.002
    assert "10.0× smaller" in by["A3"][2] and "holds" in by["A3"][3]
    assert "holds" in by["A6"][3] and "0.08" in by["A6"][2] and "3 s" in by["A6"][2]
    rows[-1]["alpha_first"] = 0.02                         # a scored shadow with a gap
    assert "does not hold" in {c[0]: c for c in S.claims(rows, 3)}["A6"][3]
    # three seeds of ten steps: the stall is judged against the seed spread
    drops = {"bf16-engine": [0.0, 1.0, -1.0], "fp32": [10.0, 11.0, 9.0]}
    rows = [_row(k, i, first=30.0 + d) for k, ds in drops.items() for i, d in enumerate(ds)]
    a1 = {c[0]: c for c in S.claims(rows, steps=10)}["A1"]
    assert "holds" in a1[3] and "not" not in a1[3] and "fp32 − bf16 drop 10.0" in a1[2]


def test_audit_rows_read_the_clip_share_at_sync(tmp_path):
    table = [{"eps": 0.01, "clip_frac": 0.3, "phantom_frac": 0.3},
             {"eps": 0.1, "clip_frac": 0.06, "phantom_frac": 0.06},
             {"eps": 0.2, "clip_frac": 0.01, "phantom_frac": 0.01}]
    d = S.audit_dir(tmp_path, 1.0, 64)
    d.mkdir(parents=True)
    (d / "audit.json").write_text(json.dumps({
        "phantom_vs_eps": table, "completions": 4, "tokens": 100,
        "metrics": {"mismatch/beta_abs_mean": 0.04}}))
    rows = S.audit_rows(tmp_path)
    first = rows[0]
    assert first["mean_len"] == 25.0 and first["clip_0.2"] == 0.01
    # 18% lies halfway between 30% and 6%: halfway in log ε between 0.01 and 0.1
    assert first["eps_18"] == pytest.approx(math.sqrt(0.01 * 0.1))
    assert all(r.get("missing") for r in rows[1:])
    md = "\n".join(S._audits_section(tmp_path))
    assert "| 1 | 64 | 4 | 25.0 | 0.04 | 1.00% | 0.032 |" in md and "missing" in md


def test_parity_trainers_claims_sit_beside_as_a_well_formed_table():
    """The section reads docs/reproduce/vllm/smollm2-135m/claims.json; a |β| in a claim must
    not split its row into more cells than the header has."""
    import re
    md = S._beside()
    assert md and any(line.startswith("| R1 |") for line in md)
    rows = [line for line in md if line.startswith("|")]
    cells = {len(re.split(r"(?<!\\)\|", line)) for line in rows}
    assert len(cells) == 1, cells
