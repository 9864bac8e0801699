"""Plots and self-contained HTML report pages for training runs, offline audits and scale sweeps.

Every page is ONE file with its PNGs inlined as base64: a report can be attached to an issue or
copied out of a run directory without its siblings, and it loads nothing from the network. Each
page counts its own decoded plots into `<body data-plots-total data-plots-rendered>` on load, so
a headless browser's `--dump-dom` proves that every plot actually rendered.
"""

from __future__ import annotations

import base64
import html
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # reports are written on headless machines and inside training loops
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from parity import metric_names as mn
from parity.errors import ParityError
from parity.files import ensure_writable
from parity.runs.dirs import lock_dir, metrics_lines, unreadable

__all__ = ["Heading", "Plot", "Table", "audit_report", "finish", "html_page", "load_metrics",
           "run_report", "scale_report", "sweep_report"]

MAX_SCATTER = 20_000  # more points add nothing visible and make the PNG (and the page) huge


# ---------------------------------------------------------------------------- page building

@dataclass
class Plot:
    """A PNG file to embed; `alt` is what a reader without the image (or a test) sees."""
    path: Path
    alt: str
    caption: str = ""


@dataclass
class Table:
    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""


@dataclass
class Heading:
    text: str


Section = str | Path | Plot | Table | Heading  # a str is a paragraph, a Path a PNG

_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.5em;border-bottom:1px solid #ddd}
img.plot{max-width:100%;display:block;margin:.5em 0}figure{margin:1em 0}
figcaption{color:#555;font-size:.9em}table{border-collapse:collapse;margin:.5em 0 1em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right;font-variant-numeric:tabular-nums}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left;min-width:9em}
caption{text-align:left;color:#555}div.table{overflow-x:auto}"""

# Set on load, never in the markup: a page whose script did not run must not claim success.
_SCRIPT = """window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img.plot"), ok = 0;
  for (var i = 0; i < imgs.length; i++) { if (imgs[i].complete && imgs[i].naturalWidth > 0) ok++; }
  document.body.setAttribute("data-plots-total", String(imgs.length));
  document.body.setAttribute("data-plots-rendered", String(ok));
});"""


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.4g}"
    return str(v)


def _section_html(s: Section) -> str:
    e = html.escape
    if isinstance(s, Path):
        s = Plot(s, alt=s.stem.replace("_", " "))
    if isinstance(s, Plot):
        data = s.path.read_bytes()
        if not data.startswith(b"\x89PNG\r\n\x1a\n"):
            raise ValueError(f"{s.path} is not a PNG file")
        src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        cap = f"<figcaption>{e(s.caption)}</figcaption>" if s.caption else ""
        return f'<figure><img class="plot" alt="{e(s.alt)}" src="{src}">{cap}</figure>'
    if isinstance(s, Table):
        cap = f"<caption>{e(s.caption)}</caption>" if s.caption else ""
        head = "".join(f"<th>{e(str(h))}</th>" for h in s.headers)
        body = "".join("<tr>" + "".join(f"<td>{e(_fmt(c))}</td>" for c in row) + "</tr>"
                       for row in s.rows)
        # a table wider than the page scrolls inside it, never past the page's edge
        return (f'<div class="table"><table>{cap}<thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table></div>")
    if isinstance(s, Heading):
        return f"<h2>{e(s.text)}</h2>"
    return f"<p>{e(str(s))}</p>"


def html_page(title: str, sections: Sequence[Section], out: Path) -> Path:
    """Write one self-contained HTML page to `out` (a file path; an existing directory gets
    `report.html` inside it) and return its path."""
    out = Path(out)
    if out.is_dir():
        out = out / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(_section_html(s) for s in sections)
    out.write_text(
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
        f"<body>\n<h1>{html.escape(title)}</h1>\n{body}\n<script>{_SCRIPT}</script>\n"
        f"</body></html>\n", encoding="utf-8")
    return out


def _save(fig: Figure, path: Path) -> Path:
    """Write and always close: pyplot keeps every open figure alive, which leaks across sweeps."""
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def finish(fig: Figure, ax: Any, path: Path, alt: str, loc: str = "best", **labels: Any) -> Plot:
    """Labels, grid and legend on `ax`; `fig` saved to `path` and closed."""
    ax.set(**labels)
    ax.grid(alpha=0.3, which="both")
    # Faint scatter points make invisible legend keys: draw the keys bigger and opaque.
    for handle in ax.legend(loc=loc, fontsize=8).legend_handles:
        if isinstance(handle, PathCollection):
            handle.set_sizes([16])
            handle.set_alpha(1)
    return Plot(_save(fig, path), alt)


# ---------------------------------------------------------------------------- run reports

def load_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl, read as `parity train --resume` reads them (one reader,
    `runs.metrics_lines`): a line a killed run left cut, or one damaged, is named in a warning
    and left out, never a reason to refuse the steps that were recorded whole."""
    path = Path(path)
    if not path.is_file():
        raise ParityError(f"{path}: metrics file not found (a run directory holds metrics.jsonl)")
    lines = metrics_lines(path)
    rows = [line.row for line in lines if line.row is not None]
    damaged = [line for line in lines if line.row is None]
    if damaged and rows:
        print(f"parity: warning: {unreadable(path, damaged)}; left out of the report",
              file=sys.stderr)
    if not rows:
        raise ParityError(f"{path}: no step recorded" + (
            f" that can be read ({unreadable(path, damaged)})" if damaged else
            " (empty metrics file)"))
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    # A resumed run can log a step twice: the later line wins. Non-numbers (null, NaN) are gaps.
    by_step: dict[float, float] = {}
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            by_step[r[mn.STEP]] = float(v)
    if not by_step:
        return None
    steps = sorted(by_step)
    return np.asarray(steps, dtype=float), np.asarray([by_step[s] for s in steps])


def _labels(run_dirs: list[Path], labels: list[str] | None) -> list[str]:
    if labels is None:
        labels = [d.resolve().name or str(d) for d in run_dirs]
        # Same directory name under different parents (two sweeps): the parent tells them apart.
        labels = [f"{d.resolve().parent.name}/{lab}" if labels.count(lab) > 1 else lab
                  for d, lab in zip(run_dirs, labels)]
    elif len(labels) != len(run_dirs):
        raise ParityError(f"{len(labels)} labels given for {len(run_dirs)} run directories")
    out: list[str] = []
    for lab in labels:
        k, name = 2, lab
        while name in out:
            name, k = f"{lab} ({k})", k + 1
        out.append(name)
    return out


def _band(ax: Any, s: tuple[np.ndarray, np.ndarray], sd: tuple | None, color: str) -> None:
    # A light ± band over the steps where both the mean and its spread were logged.
    if sd is not None:
        common, i, j = np.intersect1d(s[0], sd[0], return_indices=True)
        ax.fill_between(common, s[1][i] - sd[1][j], s[1][i] + sd[1][j], color=color, alpha=0.15)


def _steps_axis(ax: Any) -> None:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _overlay(ax: Any, runs: dict[str, list[dict]], styles: dict[str, str]) -> np.ndarray:
    """Colour says which run, linestyle which metric; returns every value drawn."""
    values = []
    for i, rows in enumerate(runs.values()):
        for m, ls in styles.items():
            if (s := _series(rows, m)) is not None:
                ax.plot(*s, color=f"C{i % 10}", linestyle=ls, lw=1.2)
                values.append(s[1])
    _steps_axis(ax)
    return np.concatenate(values)


def _legends(ax: Any, labels: Sequence[str], styles: dict[str, str]) -> None:
    # Two small legends (runs by colour, metrics by linestyle) beside the axes, never over data.
    run_keys = [Line2D([], [], color=f"C{i % 10}", label=lab) for i, lab in enumerate(labels)]
    first = ax.legend(handles=run_keys, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8,
                      title="run", title_fontsize=8)
    if len(styles) > 1:
        ax.add_artist(first)  # only then: as both legend_ and artist it drops out of the tight bbox
        kinds = [Line2D([], [], color="k", linestyle=ls, label=m) for m, ls in styles.items()]
        ax.legend(handles=kinds, loc="lower left", bbox_to_anchor=(1.02, 0), fontsize=8,
                  title="metric", title_fontsize=8)


def _present(runs: dict[str, list[dict]], metrics: dict[str, str]) -> dict[str, str]:
    return {m: v for m, v in metrics.items() if any(_series(r, m) for r in runs.values())}


def _run_figures(runs: dict[str, list[dict[str, Any]]], out: Path) -> list[Plot]:
    plots = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (lab, rows) in enumerate(runs.items()):
        s = _series(rows, mn.REWARD_MEAN)
        assert s is not None  # run_report checked
        ax.plot(*s, color=f"C{i % 10}", label=lab)
        _band(ax, s, _series(rows, mn.REWARD_STD), f"C{i % 10}")
    _steps_axis(ax)
    plots.append(finish(fig, ax, out / "reward.png",
                         f"{mn.REWARD_MEAN} against step, one line per run", ylabel=mn.REWARD_MEAN,
                         title="Reward (band: ± reward/std)"))

    if clip := _present(runs, {mn.CLIP_FRAC: "-", mn.PHANTOM_FRAC: "--",
                               mn.HIDDEN_FRAC: ":"}):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        _overlay(ax, runs, clip)
        _legends(ax, list(runs), clip)
        ax.set(ylabel="fraction of tokens", ylim=(0, None),
               title="Clipped tokens: all, phantom (numerics only), hidden (let through)")
        plots.append(Plot(_save(fig, out / "clip.png"), "clip fractions against step"))

    if beta := list(_present(runs, {mn.BETA_MEAN: "β token mean (band: ± beta_std)",
                                    mn.BETA_ABS_MEAN: "|β| token mean"}).items()):
        fig, axes = plt.subplots(1, len(beta), figsize=(6 * len(beta), 4.5), squeeze=False)
        for ax, (m, title) in zip(axes[0], beta):
            for i, (lab, rows) in enumerate(runs.items()):
                if (s := _series(rows, m)) is not None:
                    ax.plot(*s, color=f"C{i % 10}", label=lab, lw=1.2)
                    if m == mn.BETA_MEAN:
                        _band(ax, s, _series(rows, mn.BETA_STD), f"C{i % 10}")
            if m == mn.BETA_MEAN:
                ax.axhline(0, color="k", lw=0.6)
            _steps_axis(ax)
            ax.set(ylabel=m, title=title)
        _legends(axes[0][-1], list(runs), {})
        fig.tight_layout()
        plots.append(Plot(_save(fig, out / "beta.png"), "precision gap beta against step"))

    # k1 is an unbiased estimate that swings through 0 while k3 is second order and positive:
    # one shared axis (even symlog) turns both into a barcode, so each gets its own panel.
    panels = [p for p in (_present(runs, {mn.KL_K1: "-"}),
                          _present(runs, {mn.KL_K3: "-", mn.KL_EXACT: "--"})) if p]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
        for ax, styles in zip(axes[0], panels):
            v = _overlay(ax, runs, styles)
            if (v > 0).all():
                ax.set_yscale("log")
            elif mn.KL_K1 in styles:
                ax.axhline(0, color="k", lw=0.6)
            elif (nz := np.abs(v[v != 0])).size:
                ax.set_yscale("symlog", linthresh=float(np.quantile(nz, 0.1)))
            ax.set(ylabel="KL(μ‖π) estimate", title=" and ".join(styles))
        _legends(axes[0][-1], list(runs), panels[-1])
        fig.tight_layout()
        plots.append(Plot(_save(fig, out / "kl.png"), "KL estimates against step"))
    return plots


_SUMMARY = [(f"final {mn.REWARD_MEAN}", mn.REWARD_MEAN, "final"),
            (f"best {mn.REWARD_MEAN}", mn.REWARD_MEAN, "max"),
            (f"mean {mn.CLIP_FRAC}", mn.CLIP_FRAC, "mean"),
            (f"mean {mn.PHANTOM_FRAC}", mn.PHANTOM_FRAC, "mean"),
            (f"mean {mn.BETA_MEAN}", mn.BETA_MEAN, "mean"),
            (f"mean {mn.KL_K3}", mn.KL_K3, "mean")]


def run_report(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Overlay the metrics of one or more runs in PNGs under `out` and a page `out/report.html`."""
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ParityError("run_report needs at least one run directory")
    ensure_writable(out, "report --out")
    names = _labels(run_dirs, labels)
    runs = {lab: load_metrics(d / "metrics.jsonl") for lab, d in zip(names, run_dirs)}
    for (lab, rows), d in zip(runs.items(), run_dirs):
        if _series(rows, mn.REWARD_MEAN) is None:
            raise ParityError(f"run {lab!r} ({d}): no '{mn.REWARD_MEAN}' in its metrics.jsonl")
    with lock_dir(Path(out), "report --out"):   # two reports never write one page at once
        return _write_run_report(runs, run_dirs, names, Path(out))


def _write_run_report(runs: dict[str, list[dict[str, Any]]], run_dirs: list[Path],
                      names: list[str], out: Path) -> Path:
    plots = _run_figures(runs, out)

    cols = [c for c in _SUMMARY if any(_series(r, c[1]) for r in runs.values())]
    rows = []
    for lab, data in runs.items():
        row: list[Any] = [lab, len({r[mn.STEP] for r in data})]
        for _, key, how in cols:
            s = _series(data, key)
            row.append(None if s is None else
                       {"final": s[1][-1], "max": s[1].max(), "mean": s[1].mean()}[how])
        rows.append(row)
    sources = Table(["run", "metrics file"], [[lab, str(d / "metrics.jsonl")]
                                              for lab, d in zip(names, run_dirs)])
    return html_page(f"parity run report: {', '.join(names)}",
                     [Heading("Summary"), Table(["run", "steps"] + [c[0] for c in cols], rows),
                      Heading("Metrics"), *plots, Heading("Sources"), sources], out)


# ---------------------------------------------------------------------------- audit reports

def _subsample(n: int, k: int = MAX_SCATTER) -> np.ndarray:
    # Fixed seed: the same audit must give the same picture, run after run.
    return np.arange(n) if n <= k else np.sort(np.random.default_rng(0).choice(n, k, replace=False))


def _arrays(d: Mapping[str, np.ndarray], keys: Sequence[str], what: str) -> list[np.ndarray]:
    missing = [k for k in keys if k not in d]
    if missing:
        raise ParityError(f"{what}: missing arrays {missing}")
    arrs = [np.asarray(d[k], dtype=float).ravel() for k in keys]
    if len({a.size for a in arrs}) != 1 or arrs[0].size == 0:
        raise ParityError(f"{what}: arrays {list(keys)} must be non-empty and of equal length, got "
                          f"{[a.size for a in arrs]}")
    return arrs


def _prob_scatter(p_mu: np.ndarray, p_pi: np.ndarray, idx: np.ndarray, shown: str,
                  out: Path) -> Plot:
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    ax.plot([0, 1], [0, 1], color="0.4", lw=0.7, ls="--", label="π = μ", zorder=1)
    ax.scatter(p_mu[idx], p_pi[idx], s=3, alpha=0.3, linewidths=0, rasterized=True, zorder=2,
               label="tokens")
    ax.set_aspect("equal")
    return finish(fig, ax, out / "prob_scatter.png", "trainer against engine probability",
                   "upper left", xlabel="engine probability exp(ℓ_μ)", xlim=(0, 1),
                   ylabel="trainer probability exp(ℓ_π)", ylim=(0, 1),
                   title=f"Token probabilities ({shown})")


def _beta_hist(beta: np.ndarray, out: Path) -> Plot:
    mean, std = float(beta.mean()), float(beta.std())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.hist(beta, bins=100, log=True, color="C0")
    ax.axvline(mean, color="C3", lw=1, label="mean")
    ax.text(0.98, 0.95, f"mean = {mean:.3g}\nstd = {std:.3g}\nn = {beta.size:,}",
            transform=ax.transAxes, ha="right", va="top", fontsize=9,
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "#ccc"})
    return finish(fig, ax, out / "beta_hist.png", "histogram of beta", "upper left",
                   xlabel="β = ℓ_π − ℓ_s (precision gap, nats)", ylabel="tokens (log)",
                   title="Precision gap per token")


def _beta_vs_prob(p_pi: np.ndarray, beta: np.ndarray, idx: np.ndarray, shown: str,
                  out: Path) -> Plot:
    edges = np.linspace(0, 1, 11)
    which = np.clip(np.digitize(p_pi, edges) - 1, 0, 9)
    filled = [b for b in range(10) if (which == b).any()]
    centres = (edges[:-1] + edges[1:])[filled] / 2
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(p_pi[idx], beta[idx], s=2, alpha=0.2, color="0.5", linewidths=0, rasterized=True,
               label=f"tokens ({shown})")
    ax.plot(centres, [np.abs(beta[which == b]).mean() for b in filled], "o-", color="C3",
            label="binned mean |β|")
    ax.plot(centres, [beta[which == b].mean() for b in filled], "s-", color="C0",
            label="binned mean β")
    ax.axhline(0, color="k", lw=0.6)
    return finish(fig, ax, out / "beta_vs_prob.png", "beta against token probability",
                   xlabel="trainer probability exp(ℓ_π)", ylabel="β (nats)",
                   title="Precision gap against token probability")


def _seq_log_ratio(length: np.ndarray, seq_lr: np.ndarray, out: Path) -> Plot:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    si = _subsample(length.size)
    ax.scatter(length[si], seq_lr[si], s=6, alpha=0.4, linewidths=0, label="completions")
    if np.unique(length).size >= 2:
        slope, icpt = np.polyfit(length, seq_lr, 1)
        xs = np.array([length.min(), length.max()])
        ax.plot(xs, icpt + slope * xs, color="C3",
                label=f"least squares: {1000 * slope:.3g} per 1k tokens")
    ax.axhline(0, color="k", lw=0.6)
    return finish(fig, ax, out / "seq_log_ratio.png", "sequence log-ratio against length",
                   xlabel="completion length (tokens)", ylabel="Σ_t (ℓ_π − ℓ_μ)",
                   title="Sequence log-ratio against length")


def _phantom_vs_eps(table: list[dict], out: Path) -> Plot:
    eps = np.array([r["eps"] for r in table], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, mk in (("clip_frac", "o-"), ("phantom_frac", "s--"), ("hidden_frac", "^:")):
        ax.plot(eps, [r[key] for r in table], mk, label=key)
    if (eps > 0).all():
        ax.set_xscale("log")
    return finish(fig, ax, out / "phantom_vs_eps.png", "clip fractions against eps",
                   xlabel="clip range ε", ylabel="fraction of tokens", ylim=(0, None),
                   title="Clipped, phantom and hidden fractions against ε")


def audit_report(tokens: dict[str, np.ndarray], seqs: dict[str, np.ndarray], eps_table: list[dict],
                 summary: dict[str, float], out: Path, title: str,
                 verdict: str | None = None, advice: dict[str, Any] | None = None,
                 extra: Sequence[Section] = ()) -> Path:
    """Token- and sequence-level pictures of the engine–trainer gap, and `out/report.html`;
    `advice` (advice.what_to_do) opens the page, `extra` closes it."""
    l_mu, l_pi, l_s, _pos = _arrays(tokens, ["engine_logprob", "trainer_logprob", "shadow_logprob",
                                             "position"], "audit tokens")
    length, seq_lr = _arrays(seqs, ["length", "log_ratio"], "audit seqs")
    # A token one precision gives probability 0 has ℓ = −inf: count it, keep it out of the plots.
    finite = np.isfinite(l_mu) & np.isfinite(l_pi) & np.isfinite(l_s)
    dropped = int(finite.size - finite.sum())
    if not finite.any():
        raise ParityError("audit tokens: no token has finite log-probs on all three sides")
    l_mu, l_pi, l_s = l_mu[finite], l_pi[finite], l_s[finite]
    alpha, beta, log_r = l_s - l_mu, l_pi - l_s, l_pi - l_mu
    p_mu, p_pi = np.exp(l_mu), np.exp(l_pi)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    idx = _subsample(beta.size)
    shown = f"{idx.size:,} of {beta.size:,} tokens"
    table = sorted(eps_table, key=lambda r: r["eps"])
    plots = [_prob_scatter(p_mu, p_pi, idx, shown, out), _beta_hist(beta, out),
             _beta_vs_prob(p_pi, beta, idx, shown, out), _seq_log_ratio(length, seq_lr, out),
             *([_phantom_vs_eps(table, out)] if table else [])]
    kl_k3 = np.expm1(log_r) - log_r
    derived = [("tokens", beta.size), ("tokens left out (non-finite ℓ)", dropped),
               ("completions", length.size),
               ("mean α (policy change; kernel gap at θ = θ_old)", alpha.mean()),
               ("mean |α|", np.abs(alpha).mean()), ("mean β", float(beta.mean())),
               ("std β", float(beta.std())), ("mean |β|", np.abs(beta).mean()),
               ("mean log r", log_r.mean()), ("kl_k1", -log_r.mean()), ("kl_k3", kl_k3.mean())]
    sections: list[Section] = [*_advice_sections(advice),
        *([f"Verdict: {verdict}"] if verdict else []),
        Heading("Summary"), Table(["metric", "value"], [[k, v] for k, v in summary.items()]),
        Heading("Token statistics"),
        Table(["quantity", "value"], [list(r) for r in derived],
              caption="α = ℓ_s − ℓ_μ, β = ℓ_π − ℓ_s, log r = ℓ_π − ℓ_μ"),
        Heading("Plots"), *plots]
    if table:
        sections += [Heading("Clip fractions by ε"),
                     Table(["eps", "clip_frac", "phantom_frac", "hidden_frac"],
                           [[r["eps"], r["clip_frac"], r["phantom_frac"], r["hidden_frac"]]
                            for r in table])]
    else:
        sections.append("No ε table given: the clip-fraction plot is left out.")
    return html_page(title, [*sections, *extra], out)


def _advice_sections(advice: dict[str, Any] | None) -> list[Section]:
    if not advice:
        return []
    out: list[Section] = [Heading("What to do"), f"→ {advice['headline']}",
                          *[f"· {r}" for r in advice["reasons"]]]
    for title, head, rows, caption in advice["tables"]:
        out += [Heading(title), Table(head, rows, caption=caption)]
    return out


# ---------------------------------------------------------------------------- scale reports

_SCALE_METRICS = [("beta_abs_mean", "mean |β|"), ("kl_k3", "KL k3"),
                  ("phantom_frac", "phantom fraction")]


def scale_report(points: list[dict], fits: dict[str, dict], out: Path,
                 phantom_eps: float | None = None) -> Path:
    """How the gap grows with model size: `out/scale.png` and `out/report.html`.
    `phantom_eps` is the clip range the points' `phantom_frac` was measured at (for the title)."""
    if not points:
        raise ParityError("scale_report needs at least one point")
    need = ["model", "axis", "n_params"] + [m for m, _ in _SCALE_METRICS]
    for p in points:
        if missing := [k for k in need if k not in p]:
            raise ParityError(f"scale point {p.get('model', p)!r}: missing {missing}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    axes_names = list(dict.fromkeys(p["axis"] for p in points))
    color = {a: f"C{i % 10}" for i, a in enumerate(axes_names)}
    n = np.array([p["n_params"] for p in points], dtype=float)

    fig, axs = plt.subplots(1, 3, figsize=(16, 5))
    for ax, (m, name) in zip(axs, _SCALE_METRICS):
        y = np.array([p[m] for p in points], dtype=float)
        for a in axes_names:
            sel = [i for i, p in enumerate(points) if p["axis"] == a]
            ax.scatter(n[sel], y[sel], color=color[a], label=f"axis: {a}", zorder=3)
        for p, xi, yi in zip(points, n, y):
            ax.annotate(str(p["model"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xscale("log")
        # A phantom fraction of exactly 0 has no logarithm: show it honestly on a linear axis.
        log_y = bool((y > 0).all())
        ax.set_yscale("log" if log_y else "linear")
        fit = fits.get(m)
        if fit is not None:
            xs = np.geomspace(n.min(), n.max(), 50) if n.min() > 0 else np.array([])
            ax.plot(xs, 10 ** (fit["intercept"] + fit["slope"] * np.log10(xs)), "k--", lw=1,
                    label=f"fit: slope {fit['slope']:.3g} (log–log)")
        if m == "phantom_frac" and phantom_eps is not None:
            name = f"{name} at ε = {phantom_eps:g}"
        ax.set(xlabel="parameters", ylabel=m,
               title=name + ("" if log_y else " (linear y: some values are 0)"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    plot = Plot(_save(fig, out / "scale.png"), "gap metrics against parameter count")

    rows = [[p["model"], p["axis"], int(p["n_params"])] + [p[m] for m, _ in _SCALE_METRICS]
            for p in sorted(points, key=lambda p: (p["axis"], p["n_params"]))]
    fit_rows = [[m, f["slope"], f["intercept"]] for m, f in fits.items()]
    return html_page("parity scale report", [
        Heading("Gap against model size"), plot,
        Table(["model", "axis", "n_params"] + [m for m, _ in _SCALE_METRICS], rows),
        Heading("Fits: log10(metric) = intercept + slope · log10(n_params)"),
        Table(["metric", "slope", "intercept"], fit_rows) if fit_rows else "No fits given."], out)


# ---------------------------------------------------------------------------- sweep reports

_SWEEP_PANELS = [(mn.REWARD_MEAN, "reward"), (mn.LEN_MEAN, "completion length"),
                 (mn.CLIP_FRAC, "clipped fraction"), (mn.PHANTOM_FRAC, "phantom fraction"),
                 (mn.BETA_ABS_MEAN, "|β| token mean"), (mn.KL_K3, "KL k3")]


def _seed_stack(runs: list[list[dict[str, Any]]], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps logged by every seed, and the values there: [seeds, steps]."""
    series = [s for rows in runs if (s := _series(rows, key)) is not None]
    if not series:
        return None
    common = series[0][0]
    for s in series[1:]:
        common = np.intersect1d(common, s[0])
    if not common.size:
        return None
    return common, np.stack([s[1][np.searchsorted(s[0], common)] for s in series])


def sweep_report(groups: dict[str, list[Path]], out: Path,
                 panels: list[tuple[str, str]] | None = None) -> Path:
    """One line per group (a recipe on a task and model): the mean over its seeds, with a band
    from the lowest to the highest seed, in one panel per (metric, title) of `panels`.
    `out/sweep.png` and `out/report.html`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {g: [load_metrics(Path(d) / "metrics.jsonl") for d in dirs]
            for g, dirs in groups.items()}
    panels = [(k, t) for k, t in (panels or _SWEEP_PANELS)
              if any(_seed_stack(runs, k) is not None for runs in data.values())]
    cols = 3
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    longest = max(len({r[mn.STEP] for r in rows}) for runs in data.values() for rows in runs)
    # Hundreds of noisy steps per seed hide the trend: smooth long runs with a trailing mean.
    window = max(1, longest // 40)
    for ax, (key, title) in zip(axes.flat, panels):
        for i, (g, runs) in enumerate(data.items()):
            if (st := _seed_stack(runs, key)) is None:
                continue
            steps, v = st
            if window > 1 and v.shape[1] >= window:
                kernel = np.ones(window) / window
                v = np.stack([np.convolve(row, kernel, mode="valid") for row in v])
                steps = steps[window - 1:]
            ax.plot(steps, v.mean(0), color=f"C{i % 10}", lw=1.4, label=g)
            if len(v) > 1:
                ax.fill_between(steps, v.min(0), v.max(0), color=f"C{i % 10}", alpha=0.15)
        _steps_axis(ax)
        ax.set(title=title + (f" ({window}-step trailing mean)" if window > 1 else ""),
               ylabel=key)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [Line2D([], [], color=f"C{i % 10}", label=f"{g} ({len(r)} seeds)")
               for i, (g, r) in enumerate(data.items())]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8,
               bbox_to_anchor=(0.5, 0))
    fig.tight_layout(rect=(0, 0.04 + 0.02 * math.ceil(len(handles) / 4), 1, 1))
    plot = Plot(_save(fig, out / "sweep.png"), "sweep metrics against step, mean over seeds "
                "with a min-max band, one line per recipe")
    rows = []
    for g, runs in data.items():
        final = [r[-1].get(mn.REWARD_MEAN) for r in runs]
        rows.append([g, len(runs), float(np.mean([f for f in final if f is not None]))])
    return html_page("parity sweep report", [
        Heading("Sweep"), plot,
        Table(["group", "seeds", "final reward/mean (mean over seeds)"], rows)], out)
