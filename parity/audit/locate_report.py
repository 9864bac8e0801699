"""`parity audit --locate` for readers: its lines in the terminal and its part of report.html (the
trainer against itself beside β, the finding, the plot, every point's errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from rich.table import Table

from parity import metric_names as mn
from parity.audit import locate as lc
from parity.models import trace
from parity.reports import Heading, finish
from parity.reports import Table as PageTable


def print_located(result: dict[str, Any], console: Any) -> None:
    """The trainer against itself as a table beside β, then the finding and its details."""
    loc = result["locate"]
    beta = result["metrics"].get(mn.BETA_ABS_MEAN)
    t = Table(title="the trainer against itself: the same tokens and weights, another layout"
                  + (f" (mean |beta| = {beta:.3g})" if beta is not None else ""),
              title_justify="left")
    for h in ("forward", "change", "mean |dl|", f"|dl| > {lc.OUTSIDE}", "max |dl|"):
        t.add_column(h, justify="left" if h in ("forward", "change") else "right")
    for r in loc["self_gap"]:
        t.add_row(f"{r['forward']} ({r['dtype']})", lc.CHANGES[r["change"]],
                  *(("n/a",) * 3 if r["abs_mean"] is None else
                    (f"{r['abs_mean']:.3g}", f"{r['frac_outside']:.2%}", f"{r['abs_max']:.3g}")))
    console.print(t)
    if loc.get("self_gap_note"):
        console.print(f"  {loc['self_gap_note']}", highlight=False)
    layers = loc["layers"]
    console.print(f"where the gap comes from: {layers['finding']}", highlight=False)
    for line in layers.get("details", []):
        console.print(f"  {line}", highlight=False)


def _plot(layers: dict[str, Any], out: Path, title: str) -> Any:
    """Median relative error of the residual stream against layer, one line per comparison, and
    the named op's layer marked."""
    points = layers["points"]
    label = {"embed": "emb", "final_norm": "norm", "logits": "logits"}
    at = [i for i, p in enumerate(points) if p.endswith(".output") or p in label]
    ticks = [label.get(points[i]) or str(trace.layer_of(points[i])) for i in at]
    fig, ax = plt.subplots(figsize=(8, 4))
    for c, what in lc.COMPARISONS.items():
        if c in layers["curves"]:
            y = [layers["curves"][c]["median"][i] for i in at]
            ax.plot(range(len(at)), [v if v else float("nan") for v in y], marker=".",
                    label=what)
    named = layers.get("named")
    if named and trace.layer_of(named["point"]) is not None:
        x = ticks.index(str(trace.layer_of(named["point"])))
        ax.axvline(x, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"{trace.describe(named['point'])}", (x, 0.97), xycoords=("data",
                    "axes fraction"), fontsize=8, ha="left", va="top")
    ax.set_yscale("log")
    step = max(1, len(at) // 16)
    ax.set_xticks(range(0, len(at), step), ticks[::step])
    return finish(fig, ax, out / "locate.png", alt="relative error against layer",
                  xlabel="residual stream after layer", ylabel="median relative error",
                  title=title)


def locate_sections(result: dict[str, Any], out: Path) -> list[Any]:
    """report.html's part for `--locate`."""
    loc, layers = result["locate"], result["locate"]["layers"]
    beta = result["metrics"].get(mn.BETA_ABS_MEAN)
    rows = [[r["forward"], r["dtype"], lc.CHANGES[r["change"]], r["tokens"], r["abs_mean"],
             r["frac_outside"], r["abs_max"]] for r in loc["self_gap"]]
    beside = f"; beside mean |β| = {beta:.4g}" if beta is not None else ""
    curves = {c: v for c, v in layers["curves"].items() if c in lc.COMPARISONS}
    points = [[p, trace.kind(p), *(curves[c]["median"][i] for c in curves)]
              for i, p in enumerate(layers["points"])]
    logits = [[c, v["tokens"], v["abs_dlogp_mean"], v["abs_dlogp_max"], v["kl_mean"]]
              for c, v in layers.get("logits", {}).items()]
    return [Heading("The trainer against itself"),
            PageTable(["forward", "dtype", "change", "tokens", "mean |Δℓ|",
                       f"share |Δℓ| > {lc.OUTSIDE}", "max |Δℓ|"], rows,
                      caption=f"the same tokens and weights in another layout{beside}"),
            *([loc["self_gap_note"]] if loc.get("self_gap_note") else []),
            Heading("Where the gap comes from"), f"Finding: {layers['finding']}",
            *layers.get("details", []),
            _plot(layers, out, f"{layers['sequences']} sequences, {layers['tokens']} tokens"),
            PageTable(["against the trainer", "tokens", "mean |Δℓ| of the sampled token",
                       "max |Δℓ|", "mean KL"], logits,
                      caption="at the logits: what moves a log-prob (a shift common to the "
                              "vocabulary moves neither)"),
            PageTable(["point", "op", *(f"{c} median" for c in curves)],
                      points, caption="relative error ‖x − x_ref‖ / ‖x_ref‖ per token (decode: "
                      "the last token of each sequence); "
                      + "; ".join(f"{c}: {lc.COMPARISONS[c]}" for c in curves))]
