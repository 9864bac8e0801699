"""`parity audit`: sampled audits, another system's rollouts, the size ladder, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_helpers import run_main
from parity.audit.command import AuditSettings, audit
from parity.audit.scale import scale
from parity.diagnostics import DUMP_COLUMNS

pytestmark = pytest.mark.e2e

CONTRACT_METRICS = ["clip/frac", "clip/phantom_frac", "clip/hidden_frac", "clip/alpha_frac",
                  "mismatch/alpha_abs_mean", "mismatch/beta_mean", "mismatch/beta_abs_mean",
                  "mismatch/beta_std", "mismatch/beta_adv_corr", "mismatch/kl_k1",
                  "mismatch/kl_k3", "mismatch/prob_diff_abs_mean", "mismatch/prob_diff_max",
                  "mismatch/prob_diff_min", "mismatch/kl_exact"]
PLOTS = ["prob_scatter.png", "beta_hist.png", "beta_vs_prob.png", "seq_log_ratio.png",
         "phantom_vs_eps.png"]


def _main(*args: str) -> tuple[int, str, str]:
    p = run_main(*args)
    return p.returncode, p.stdout, p.stderr


def parity_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ}, timeout=600)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, text_model):
    out = tmp_path_factory.mktemp("audit") / "a"
    res = audit(AuditSettings(model=str(text_model), task="neg-length", samples=48, group=8,
                              max_new_tokens=16, batch_size=16, progress=False), out)
    return out, res


def test_sampled_audit_writes_everything(sampled):
    out, res = sampled
    saved = json.loads((out / "audit.json").read_text())
    assert saved["metrics"] == res["metrics"]
    assert set(CONTRACT_METRICS) <= set(res["metrics"]), set(CONTRACT_METRICS) - set(res["metrics"])
    assert res["completions"] == 48 and res["advantages"]
    eps = [row["eps"] for row in res["phantom_vs_eps"]]
    assert 0.2 in eps and 0.01 in eps and eps == sorted(eps)
    # Fewer tokens leave the trust region as it widens.
    ph = [row["clip_frac"] for row in res["phantom_vs_eps"]]
    assert all(a >= b for a, b in zip(ph, ph[1:]))
    for name in PLOTS + ["report.html"]:
        assert (out / name).stat().st_size > 1000, name
    t = pq.read_table(out / "tokens.parquet")
    assert list(t.column_names) == list(DUMP_COLUMNS)
    assert t.num_rows == res["tokens"]
    assert res["metrics"]["mismatch/beta_abs_mean"] > 0          # bf16 vs fp32 disagree
    assert res["metrics"]["mismatch/kl_exact"] > 0


def test_the_report_opens_with_what_to_do(sampled):
    """The page's first section is the advice: its headline, the user's figures in the first
    row of the reference table (the audit's own), then the verdict and the rest."""
    out, res = sampled
    adv = res["advice"]
    assert adv["status"] in ("fine", "fix") and adv["headline"]
    page = (out / "report.html").read_text()
    body = page[page.index("<body>"):]
    assert body.index("What to do") < body.index("Verdict:") < body.index("Summary")
    assert adv["headline"].replace("'", "&#x27;") in page
    first = body[body.index("your audit"):]
    gap = res["metrics"]["mismatch/log_ratio_abs_mean"]
    assert first.index(f"{gap:.3g}") < first.index("</tr>")
    for name in ("sampling/sampling_logp_difference/mean", "training/rollout_probs_diff_mean",
                 "train/train_rollout_logprob_abs_diff", "rollout_corr/k3_kl"):
        assert name in page


def test_rollouts_from_another_system_give_the_same_audit(sampled, tmp_path, text_model):
    """Write the sampled audit's completions as an audit input file, as another system would;
    `--rollouts` on it must measure the same β and clip fractions."""
    out, res = sampled
    t = pq.read_table(out / "tokens.parquet").to_pandas()
    from parity.models.loading import load_policy
    from parity.tasks import build_task
    model, tok = load_policy(text_model)
    task = build_task("neg-length", None, text_model, model, tok, 16, None, 0, 1.0)
    rows = []
    for _, g in t.groupby("sample_id", sort=True):
        g = g.sort_values("position")
        rows.append({"prompt_token_ids": task.prompt_ids[int(g["prompt_id"].iloc[0])],
                     "completion_token_ids": [int(x) for x in g["token_id"]],
                     "engine_logprobs": [float(x) for x in g["engine_logprob"]],
                     "advantage": float(g["advantage"].iloc[0])})
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = parity_cli("audit", "--rollouts", str(path), "--model", str(text_model),
                      "--batch-size", "16", "--out", str(tmp_path / "b"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "verdict" in proc.stdout
    got = json.loads((tmp_path / "b" / "audit.json").read_text())
    for k in ("mismatch/beta_mean", "mismatch/beta_abs_mean", "mismatch/kl_k3", "clip/frac"):
        assert got["metrics"][k] == pytest.approx(res["metrics"][k], rel=1e-4, abs=1e-7), k
    assert "mismatch/kl_exact" not in got["metrics"]  # μ's full distribution is not in a file
    # The same file as parquet, with rewards instead of advantages.
    for r in rows:
        r["reward"] = -float(len(r["completion_token_ids"]))
        del r["advantage"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rollouts.parquet")
    proc = parity_cli("audit", "--rollouts", str(tmp_path / "rollouts.parquet"), "--model",
                      str(text_model), "--batch-size", "16", "--out", str(tmp_path / "c"),
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "c" / "audit.json").read_text())
    assert got["metrics"]["mismatch/beta_adv_corr"] == pytest.approx(
        res["metrics"]["mismatch/beta_adv_corr"], abs=1e-3)


GOOD = {"prompt_token_ids": [5, 6, 7], "completion_token_ids": [8, 9, 1],
        "engine_logprobs": [-0.5, -1.0, -0.1]}


def _bad(**change):
    row = {**GOOD, **change}
    return [GOOD, {k: v for k, v in row.items() if v is not None}]


BAD_FILES = [
    ("lengths", _bad(engine_logprobs=[-0.5, -1.0]), ["row 1", "engine_logprobs", "2 values for 3"]),
    ("positive", _bad(engine_logprobs=[-0.5, 2.0, -0.1]), ["row 1", "positive"]),
    ("vocab", _bad(completion_token_ids=[8, 99999, 1]), ["row 1", "completion_token_ids",
                                                         "99999", "vocabulary"]),
    ("negative id", _bad(prompt_token_ids=[5, -1]), ["row 1", "prompt_token_ids", "-1"]),
    ("empty", _bad(completion_token_ids=[], engine_logprobs=[]), ["row 1",
                                                                  "completion_token_ids",
                                                                  "empty completion"]),
    ("missing", _bad(engine_logprobs=None), ["row 1", "missing column 'engine_logprobs'"]),
    ("reward", _bad(reward="high"), ["row 1", "reward", "finite number"]),
    ("not ids", _bad(prompt_token_ids="hello"), ["row 1", "prompt_token_ids", "integer"]),
    ("huge reward", _bad(reward=1e39), ["row 1", "'reward'", "within +-1e+30, got 1e+39"]),
    ("no float", _bad(engine_logprobs=[-0.5, -10**400, -0.1]), ["row 1", "engine_logprobs",
                                                                "integer of 1329 bits",
                                                                "is not a log-probability"]),
]


# Parquet columns are typed, so a string where ids belong cannot even be written there; and a
# table takes its columns from the first row, which has no reward.
CASES = [(b, "jsonl") for b in BAD_FILES] + [(b, "parquet") for b in BAD_FILES
                                            if b[0] not in ("reward", "not ids", "missing",
                                                            "huge reward", "no float")]


@pytest.mark.parametrize("case,fmt", CASES, ids=[f"{c[0]}-{f}" for c, f in CASES])
def test_bad_audit_files(tmp_path, text_model, capsys, case, fmt):
    name, rows, words = case
    path = tmp_path / f"bad.{fmt}"
    if fmt == "jsonl":
        # json.dumps writes NaN/Infinity, which Python's json reads back: the check is ours.
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    code, _, err = _main("audit", "--rollouts", str(path), "--model",
                                  str(text_model), "--out", str(tmp_path / "out"),
                                  "--no-progress")
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("parity: error:") and str(path) in line
    for w in words:
        assert w in line, (w, line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_non_finite_log_probs_are_left_out_and_counted_with_one_warning(tmp_path, text_model,
                                                                       capsys, fmt):
    """A NaN, a -inf and a log-prob beyond float32 (-inf there): the audit measures the other
    tokens, counts the three in mismatch/non_finite_tokens and says so once."""
    rows = [GOOD, {**GOOD, "engine_logprobs": [-0.5, float("nan"), -0.1]},
            {**GOOD, "engine_logprobs": [float("-inf"), -1.0, -1e39]}]
    path = tmp_path / f"r.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    code, _, err = _main("audit", "--rollouts", str(path), "--model",
                                  str(text_model), "--out", str(tmp_path / "out"),
                                  "--no-progress")
    assert code == 0, err
    said = [x for x in err.splitlines() if "NaN or inf" in x]
    assert said == ["parity: warning: 3 token log-probs from the engine (l_mu) or the trainer's "
                    "forwards are NaN or inf and are left out of every figure (counted in "
                    "mismatch/non_finite_tokens)"]
    m = json.loads((tmp_path / "out" / "audit.json").read_text())["metrics"]
    assert m["mismatch/non_finite_tokens"] == 3
    assert all(v is None or math.isfinite(v) for v in m.values() if isinstance(v, float))
    assert m["mismatch/kl_k1"] is not None and math.isfinite(m["mismatch/kl_k1"])


def test_parquet_missing_column_and_unreadable_files(tmp_path, text_model, capsys):
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in GOOD.items()
                                          if k != "completion_token_ids"}]), tmp_path / "m.parquet")
    (tmp_path / "j.jsonl").write_text(json.dumps(GOOD) + "\n{not json\n")
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "e.jsonl").write_text("\n")
    for f, words in (("m.parquet", ["missing column 'completion_token_ids'"]),
                     ("j.jsonl", ["line 2", "not valid JSON"]),
                     ("x.csv", [".jsonl or .parquet"]),
                     ("e.jsonl", ["no rows"]),
                     ("nope.jsonl", ["does not exist"])):
        code, _, err = _main("audit", "--rollouts", str(tmp_path / f),
                                      "--model", str(text_model), "--out",
                                      str(tmp_path / "out"), "--no-progress")
        assert code == 2, (f, err)
        for w in words:
            assert w in err, (f, w, err)


def test_audit_prompts_file_without_advantages(tmp_path, text_model):
    (tmp_path / "p.txt").write_text("The function returns\nimport os\n")
    proc = parity_cli("audit", "--prompts", str(tmp_path / "p.txt"), "--model", str(text_model),
                      "--samples", "16", "--group", "4", "--max-new-tokens", "8",
                      "--out", str(tmp_path / "a"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert not res["advantages"] and res["completions"] == 16
    assert "mismatch/beta_adv_corr" not in res["metrics"]


def test_scale_over_a_small_ladder(tmp_path, text_model, gpt2_model):
    gpt2 = gpt2_model
    res = scale(AuditSettings(model="x", task="neg-length", samples=16, group=4,
                              max_new_tokens=8, progress=False), tmp_path / "s",
                [str(text_model), str(gpt2)])
    assert [p["model"] for p in res["points"]] == [str(text_model), str(gpt2)]
    assert all(p["n_params"] > 0 and p["beta_abs_mean"] > 0 for p in res["points"])
    f = res["fits"]["beta_abs_mean"]
    assert set(f["at"]) == {"6e+08", "1.5e+09"} and f["points"] == 2
    assert (tmp_path / "s" / "scale.png").stat().st_size > 1000
    assert (tmp_path / "s" / "models").is_dir()


# ---- a refused audit leaves nothing behind (docs/errors.md, "Audit files")

def _mismatched_model(text_model: Path, dest: Path) -> Path:
    """A copy whose config.json asks for a vocabulary its weights do not have: refused when the
    audit loads it, after an earlier model of a ladder has been audited."""
    import shutil
    shutil.copytree(text_model, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["vocab_size"] += 16
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


REFUSED_AUDITS = {
    "prompts not UTF-8": (lambda d: (d / "p.txt").write_bytes(b"import os\ncaf\xe9\n"),
                          ["--prompts", "{d}/p.txt"], ["p.txt", "byte 0xe9 at offset 13 (line 2)"]),
    "prompts not JSON": (lambda d: (d / "p.jsonl").write_text('{"prompt": "a"}\n{oops\n'),
                         ["--prompts", "{d}/p.jsonl"], ["line 2", "not valid JSON"]),
    "rollouts not UTF-8": (lambda d: (d / "r.jsonl").write_bytes(b'{"a": "\xff"}\n'),
                           ["--rollouts", "{d}/r.jsonl"], ["r.jsonl", "byte 0xff at offset 7"]),
    "reward NaN while sampling": (
        lambda d: (d / "rw.py").write_text("def nan(p, c, **k):\n    return [float('nan')] * "
                                           "len(c)\n"),
        ["--task", "neg-length", "--reward", "{d}/rw.py:nan", "--samples", "8", "--group", "2"],
        ["rewards must be finite"]),
    "an fp16 check that is not one": (
        lambda d: (d / "fp16_check.json").write_text('{"verdict": "fine"}'),
        ["--task", "neg-length", "--fp16-check", "{d}/fp16_check.json"],
        ["fp16_check.json", "not a `parity fp16-check` result"]),
    "scale: a model path that does not exist": (
        lambda d: None, ["--scale", "--models", "{model},{d}/nope", "--samples", "8", "--group",
                         "2"], ["nope"]),
    "scale: the second model refused after the first was audited": (
        lambda d: None, ["--scale", "--models", "{model},{d}/mismatch", "--samples", "8",
                         "--group", "2"], ["config.json does not match the weights"]),
}


@pytest.mark.parametrize("case", list(REFUSED_AUDITS))
def test_a_refused_audit_leaves_no_output(tmp_path, text_model, capsys, case):
    make, args, words = REFUSED_AUDITS[case]
    make(tmp_path)
    if "mismatch" in " ".join(args):
        _mismatched_model(text_model, tmp_path / "mismatch")
    out = tmp_path / "out"
    code, _, err = _main("audit", *[a.format(d=tmp_path, model=text_model)
                                                      for a in args],
                                  "--model", str(text_model), "--max-new-tokens", "4",
                                  "--out", str(out), "--no-progress")
    lines = [x for x in err.splitlines() if x.startswith("parity: error:")]
    assert code == 2 and len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def test_independent_shadow_kernels_leave_a_kernel_gap_the_engines_do_not(text_model, tmp_path):
    """bf16 against fp32: a shadow on the engine's attention reproduces ℓ_μ at θ = θ_old up to
    batch-shape noise; on the trainer's own attention (SDPA instead of the engine's eager
    path), as a trainer against a separate inference engine must, the bf16 rounding of another
    kernel shows up as a kernel gap of the order of β itself (measured: 4e-3 against 1e-7, with
    |β| 6e-3, on this model)."""
    gap = {}
    for kernels in ("engine", "independent"):
        res = audit(AuditSettings(model=str(text_model), task="neg-length", samples=32, group=8,
                                  max_new_tokens=16, shadow_kernels=kernels, progress=False,
                                  threads=1).validate(), tmp_path / kernels, report=False)
        gap[kernels] = res["metrics"]["mismatch/kernel_gap_abs_mean"]
    assert gap["engine"] < 1e-5 < 1e-3 < gap["independent"]


def test_an_fp32_lm_head_is_audited_on_both_sides(text_model, tmp_path):
    """`lm_head_fp32` puts the fp32 head on the engine and on the shadow alike: the shadow still
    reproduces ℓ_μ at θ = θ_old (a head left in bf16 on either side would leave the head's
    rounding as a kernel gap), while the engine's log-probs, and so β, are another engine's."""
    res = {}
    for head in (False, True):
        res[head] = audit(AuditSettings(model=str(text_model), task="neg-length", samples=16,
                                        group=8, max_new_tokens=16, lm_head_fp32=head,
                                        progress=False, threads=1).validate(),
                          tmp_path / str(head), report=False)
    assert res[True]["lm_head_fp32"] is True
    assert res[True]["metrics"]["mismatch/kernel_gap_abs_mean"] < 1e-5
    assert (res[True]["metrics"]["mismatch/beta_abs_mean"]
            != res[False]["metrics"]["mismatch/beta_abs_mean"])
