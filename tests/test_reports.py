"""parity.reports on real files: PNGs, self-contained pages, and a headless browser that proves
every embedded plot decodes and renders (the page counts them into <body data-plots-*>)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from parity.errors import ParityError
from parity.reports import audit_report, html_page, run_report, scale_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = {"reward.png", "clip.png", "beta.png", "kl.png"}
AUDIT_PNGS = {"prob_scatter.png", "beta_hist.png", "beta_vs_prob.png", "seq_log_ratio.png",
              "phantom_vs_eps.png"}


# ---------------------------------------------------------------------------- inputs

def _write_run(d: Path, seed: int, steps: int = 20, with_hidden: bool = True) -> Path:
    """A metrics.jsonl with plausible curves: reward rising, small negative β, KL k1 that dips
    below 0 now and then (it is an unbiased, not a positive, estimate)."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            row = {"step": step,
                   "reward/mean": float(0.2 + 0.7 * step / steps + 0.03 * rng.standard_normal()),
                   "reward/std": float(0.3 - 0.1 * step / steps),
                   "clip/frac": float(0.02 + 0.01 * rng.random()),
                   "clip/phantom_frac": float(0.005 + 0.002 * rng.random()),
                   "mismatch/beta_mean": float(-1e-3 + 2e-4 * rng.standard_normal()),
                   "mismatch/beta_abs_mean": float(8e-3 + 1e-3 * rng.random()),
                   "mismatch/beta_std": 1.2e-2,
                   "mismatch/kl_k1": float(1e-3 * rng.standard_normal()),
                   "mismatch/kl_k3": float(5e-4 + 1e-4 * rng.random())}
            if with_hidden:
                row["clip/hidden_frac"] = float(0.001 * rng.random())
            f.write(json.dumps(row) + "\n")
    return d


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    return [_write_run(tmp_path / "runs" / "bf16-engine", 0),
            _write_run(tmp_path / "runs" / "bf16-shadow", 1, steps=15, with_hidden=False)]


def _audit_inputs(n_seq: int = 60, vocab: int = 50, seed: int = 0):
    """Engine log-probs from a real log-softmax of random logits; the shadow forward adds a
    small policy change, the trainer a smaller, negatively biased precision gap."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 120, size=n_seq)
    l_mu_all, position, seq_ratio = [], [], []
    for n in lengths:
        logits = 2.0 * rng.standard_normal((n, vocab))
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        probs = np.exp(logp)
        ids = [rng.choice(vocab, p=p / p.sum()) for p in probs]
        l_mu_all.append(logp[np.arange(n), ids])
        position.append(np.arange(n))
    l_mu = np.concatenate(l_mu_all)
    l_s = l_mu + 1e-3 * rng.standard_normal(l_mu.size)
    l_pi = np.minimum(l_s + 4e-3 * rng.standard_normal(l_mu.size) - 5e-4, 0.0)
    start = 0
    for n in lengths:
        seq_ratio.append(float((l_pi - l_mu)[start:start + n].sum()))
        start += n
    tokens = {"engine_logprob": l_mu, "trainer_logprob": l_pi, "shadow_logprob": l_s,
              "position": np.concatenate(position).astype(float)}
    seqs = {"length": lengths.astype(float), "log_ratio": np.asarray(seq_ratio)}
    eps_table = [{"eps": e, "clip_frac": 0.05 / (1 + 50 * e), "phantom_frac": 0.01 / (1 + 200 * e),
                  "hidden_frac": 0.002 / (1 + 100 * e)} for e in (0.3, 0.01, 0.05, 0.1, 0.2)]
    summary = {"mismatch/beta_mean": float((l_pi - l_s).mean()),
               "mismatch/kl_k3": float(np.mean(np.expm1(l_pi - l_mu) - (l_pi - l_mu))),
               "clip/phantom_frac": 0.0123456789}
    return tokens, seqs, eps_table, summary


SCALE_POINTS = [
    {"model": "d2", "axis": "depth", "n_params": 2_000_000, "beta_abs_mean": 3e-3,
     "kl_k3": 1e-5, "phantom_frac": 0.0},
    {"model": "d4", "axis": "depth", "n_params": 4_000_000, "beta_abs_mean": 4.1e-3,
     "kl_k3": 1.8e-5, "phantom_frac": 1e-4},
    {"model": "d8", "axis": "depth", "n_params": 8_000_000, "beta_abs_mean": 5.9e-3,
     "kl_k3": 3.5e-5, "phantom_frac": 3e-4},
    {"model": "w256", "axis": "width", "n_params": 6_000_000, "beta_abs_mean": 5e-3,
     "kl_k3": 2.6e-5, "phantom_frac": 2e-4},
    {"model": "v32k", "axis": "vocab", "n_params": 12_000_000, "beta_abs_mean": 6.5e-3,
     "kl_k3": 4e-5, "phantom_frac": 5e-4},
    {"model": "base", "axis": "base", "n_params": 3_000_000, "beta_abs_mean": 3.6e-3,
     "kl_k3": 1.4e-5, "phantom_frac": 6e-5},
]
SCALE_FITS = {"beta_abs_mean": {"slope": 0.5, "intercept": -5.65},
              "kl_k3": {"slope": 0.95, "intercept": -11.0}}  # phantom_frac deliberately unfitted


# ---------------------------------------------------------------------------- helpers

def _assert_pngs(out: Path, names: set[str]) -> None:
    assert {p.name for p in out.glob("*.png")} == names
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 5_000, f"{name} is suspiciously small ({len(data)} bytes)"


def _assert_self_contained(page: Path, n_plots: int) -> str:
    text = page.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    assert not re.search(r'src="(?!data:image/png;base64,)', text), "non-data src in the page"
    assert text.count('<img class="plot"') == n_plots
    assert len(re.findall(r'<img class="plot" alt="[^"]+"', text)) == n_plots  # every plot has alt
    return text


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _render(page: Path, tmp_path: Path) -> tuple[int, int]:
    """(total, rendered) as the page's own load handler counted them in a real browser."""
    exe = _browser()
    if exe is None:
        if os.environ.get("PARITY_REQUIRE_BROWSER") == "1":
            pytest.fail("PARITY_REQUIRE_BROWSER=1 but no chromium/chromium-browser on PATH")
        pytest.skip("no chromium/chromium-browser on PATH: cannot check the pages render "
                    "(set PARITY_REQUIRE_BROWSER=1 to make this a failure)")
    profile = tmp_path / f"chromium-profile-{page.parent.name}"  # no clash with a running browser
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--no-first-run", f"--user-data-dir={profile}",
           "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    body = re.search(r"<body[^>]*>", proc.stdout)
    assert body, f"no <body> in chromium's dump (rc {proc.returncode}):\n{proc.stderr[-2000:]}"
    total = re.search(r'data-plots-total="(\d+)"', body.group(0))
    rendered = re.search(r'data-plots-rendered="(\d+)"', body.group(0))
    assert total and rendered, f"the page's load handler did not run: {body.group(0)}"
    return int(total.group(1)), int(rendered.group(1))


# ---------------------------------------------------------------------------- run reports

def test_run_report_writes_every_plot_and_a_self_contained_page(two_runs, tmp_path):
    out = tmp_path / "report"
    page = run_report(two_runs, out)
    assert page == out / "report.html"
    _assert_pngs(out, RUN_PNGS)
    text = _assert_self_contained(page, len(RUN_PNGS))
    assert "bf16-engine" in text and "bf16-shadow" in text
    # The summary table: 20 and 15 steps, and the columns for the metrics the runs have.
    for col in ("final reward/mean", "best reward/mean", "mean clip/frac",
                "mean clip/phantom_frac", "mean mismatch/beta_mean", "mean mismatch/kl_k3"):
        assert f"<th>{col}</th>" in text
    assert "<td>20</td>" in text and "<td>15</td>" in text


def test_run_report_skips_absent_metrics_and_disambiguates_labels(tmp_path):
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    for d, r in ((a, 0.1), (b, 0.2)):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "reward/mean": r * s, "clip/frac": 0.01}) + "\n"
            for s in range(1, 6)))
    page = run_report([a, b], tmp_path / "out")
    _assert_pngs(tmp_path / "out", {"reward.png", "clip.png"})
    text = _assert_self_contained(page, 2)
    assert "a/run" in text and "b/run" in text
    run_report([a, b], tmp_path / "out2", labels=["x", "x"])
    assert "x (2)" in (tmp_path / "out2" / "report.html").read_text()


def test_malformed_metrics_line_names_file_and_line(two_runs, tmp_path, capsys):
    """Read as `--resume` reads it (runs.metrics_lines): the damaged line is named in a
    warning and left out; every other step is reported."""
    path = two_runs[1] / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[6] = '{"step": 7, "reward/mean": 0.5,\n'  # truncated by a crash mid-write
    path.write_text("".join(lines))
    run_report(two_runs, tmp_path / "out")
    err = capsys.readouterr().err
    assert f"parity: warning: {path}: line 7 could not be read" in err, err
    assert f"<td>{len(lines) - 1}</td>" in (tmp_path / "out" / "report.html").read_text()


def test_metrics_that_are_not_utf8_name_the_byte(two_runs, tmp_path, capsys):
    path = two_runs[0] / "metrics.jsonl"
    data = path.read_bytes()
    cut = data.index(b"\n") + 1
    path.write_bytes(data[:cut] + b"\xff" + data[cut:])
    run_report(two_runs, tmp_path / "out")
    assert (f"{path}: line 2 (byte 0xff at offset {cut} is not UTF-8) could not be read"
            in capsys.readouterr().err)
    # nothing readable: a refusal naming the byte, and no directory left behind
    path.write_bytes(b"\xff\n")
    with pytest.raises(ParityError, match=re.escape("line 1 (byte 0xff at offset 0 is not "
                                                    "UTF-8) could not be read")):
        run_report(two_runs, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_missing_or_empty_metrics_is_a_user_error(two_runs, tmp_path):
    (two_runs[0] / "metrics.jsonl").unlink()
    with pytest.raises(ParityError, match="metrics.jsonl"):
        run_report(two_runs, tmp_path / "out")
    (two_runs[0] / "metrics.jsonl").write_text("\n")
    with pytest.raises(ParityError, match="empty"):
        run_report(two_runs, tmp_path / "out")


def test_missing_reward_names_the_run(tmp_path):
    d = tmp_path / "no-reward"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "clip/frac": 0.1}) + "\n")
    with pytest.raises(ParityError, match="no-reward.*reward/mean"):
        run_report([d], tmp_path / "out")


# ---------------------------------------------------------------------------- audit, scale

def test_audit_report_writes_its_plots_and_page(tmp_path):
    tokens, seqs, eps_table, summary = _audit_inputs()
    out = tmp_path / "audit"
    page = audit_report(tokens, seqs, eps_table, summary, out, title="audit <bf16 vs fp32>")
    _assert_pngs(out, AUDIT_PNGS)
    text = _assert_self_contained(page, len(AUDIT_PNGS))
    assert "audit &lt;bf16 vs fp32&gt;" in text and "<bf16" not in text  # escaped
    assert "<td>0.01235</td>" in text  # 4 significant digits


def test_audit_report_subsamples_large_inputs_deterministically(tmp_path):
    rng = np.random.default_rng(3)
    n = 30_000
    l_mu = np.log(rng.uniform(0.01, 1.0, n))
    tokens = {"engine_logprob": l_mu, "trainer_logprob": l_mu + 1e-3 * rng.standard_normal(n),
              "shadow_logprob": l_mu, "position": np.arange(n, dtype=float)}
    seqs = {"length": np.full(300, 100.0), "log_ratio": rng.standard_normal(300)}
    a = audit_report(tokens, seqs, [], {}, tmp_path / "a", "a")
    b = audit_report(tokens, seqs, [], {}, tmp_path / "b", "b")
    png = "prob_scatter.png"
    assert (a.parent / png).read_bytes() == (b.parent / png).read_bytes()
    assert not (a.parent / "phantom_vs_eps.png").exists()  # no eps table given: plot left out


def test_scale_report_writes_its_plot_and_page(tmp_path):
    out = tmp_path / "scale"
    page = scale_report(SCALE_POINTS, SCALE_FITS, out)
    _assert_pngs(out, {"scale.png"})
    text = _assert_self_contained(page, 1)
    for p in SCALE_POINTS:
        assert f"<td>{p['model']}</td>" in text


# ---------------------------------------------------------------------------- a real browser

@pytest.mark.e2e
def test_headless_browser_renders_every_plot(two_runs, tmp_path):
    tokens, seqs, eps_table, summary = _audit_inputs()
    pages = {run_report(two_runs, tmp_path / "run"): len(RUN_PNGS),
             audit_report(tokens, seqs, eps_table, summary, tmp_path / "audit", "audit"):
                 len(AUDIT_PNGS),
             scale_report(SCALE_POINTS, SCALE_FITS, tmp_path / "scale"): 1}
    for page, n in pages.items():
        assert n > 0
        assert _render(page, tmp_path) == (n, n), page

    # The check can fail: corrupt one image's payload and the browser must count it as broken.
    page = next(iter(pages))
    text = page.read_text(encoding="utf-8")
    i = text.index("base64,") + len("base64,")
    bad = tmp_path / "broken" / "report.html"
    bad.parent.mkdir()
    bad.write_text(text[:i] + "A" * 64 + text[i + 64:], encoding="utf-8")
    total, rendered = _render(bad, tmp_path)
    assert total == len(RUN_PNGS) and rendered == total - 1


def test_html_page_escapes_and_embeds(tmp_path):
    src = tmp_path / "fig.png"
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    fig.savefig(src)
    plt.close(fig)
    page = html_page('<script>alert("x")</script>', ["a & b", src], tmp_path / "p.html")
    text = _assert_self_contained(page, 1)
    assert "&lt;script&gt;alert" in text and "a &amp; b" in text


# ---------------------------------------------------------------------------- end to end

@pytest.mark.e2e
def test_parity_report_on_real_runs_renders(tmp_path, text_model):
    """`parity train` twice (the mismatch and the reference), then `parity report` over both:
    every figure, the page, and the browser renders each plot."""
    from parity.cli import main
    for recipe in ("bf16-engine", "fp32"):
        assert main(["train", "--model", "text-xs", "--recipe", recipe, "--steps", "3",
                     "--prompts-per-step", "2", "--samples-per-prompt", "4",
                     "--max-new-tokens", "8", "--out", str(tmp_path / recipe),
                     "--no-progress"]) == 0
    assert main(["report", str(tmp_path / "bf16-engine"), str(tmp_path / "fp32"),
                 "--out", str(tmp_path / "report")]) == 0
    _assert_pngs(tmp_path / "report", RUN_PNGS)
    page = tmp_path / "report" / "report.html"
    text = _assert_self_contained(page, len(RUN_PNGS))
    assert "bf16-engine" in text and "fp32" in text
    assert _render(page, tmp_path) == (len(RUN_PNGS), len(RUN_PNGS))
    assert main(["report", str(tmp_path / "missing")]) == 2
