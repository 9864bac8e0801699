"""`parity audit --scale`: the audit repeated over the testbed's size ladder, each metric fitted
against parameter count and extrapolated to real model sizes."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

from rich.table import Table

from parity import metric_names as mn
from parity import testbed, ui
from parity.audit.command import audit
from parity.config import AuditSettings
from parity.errors import ParityError
from parity.reports import scale_report
from parity.runs.dirs import check_run_dir, lock_dir

SMALL_EPS = 0.01
FIT_METRICS = ("beta_abs_mean", "kl_k3", "kl_exact", "phantom_frac")
EXTRAPOLATE = (0.6e9, 1.5e9)


def fit_loglog(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """log10(y) = intercept + slope · log10(x) by least squares; None without two positive y."""
    pts = [(math.log10(x), math.log10(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    fit = {"slope": slope, "intercept": intercept, "points": len(pts)}
    if len(pts) > 2:  # the slope's standard error from the residuals, n − 2 degrees of freedom
        rss = sum((y - intercept - slope * x) ** 2 for x, y in pts)
        fit["slope_se"] = math.sqrt(rss / (len(pts) - 2) / sxx)
    return fit


def _same_audit(res: dict[str, Any], a: AuditSettings) -> bool:
    keys = ("engine_dtype", "trainer_dtype", "eps", "max_new_tokens", "seed")
    return (all(res.get(k) == getattr(a, k) for k in keys) and res.get("completions") == a.samples
            and res.get("input") == f"task {a.task}")


def _ladder_points(a: AuditSettings, out: Path, models: list[str],
                   done: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]]:
    """One audit per model (or its earlier result from `done`), as a point of the fit."""
    axis_of = {}
    for axis, names in testbed.LADDER_AXES.items():
        for n in names:
            axis_of[n] = "base" if n in axis_of else axis
    points = []
    for name in models:
        if name in testbed.SPECS:
            testbed.ensure(name, progress=a.progress)
        sub = dataclasses.replace(a, model=name)
        res = (done or {}).get(name)
        if res is None or not _same_audit(res, sub):
            res = audit(sub, out / "models" / Path(name).name, report=False)
        m = res["metrics"]
        small = next((row["phantom_frac"] for row in res["phantom_vs_eps"]
                      if row["eps"] == SMALL_EPS), None)
        points.append({"model": name, "axis": axis_of.get(name, "other"),
                       "n_params": res["n_params"],
                       "beta_abs_mean": m.get(mn.BETA_ABS_MEAN, 0.0),
                       "kl_k3": m.get(mn.KL_K3, 0.0),
                       "kl_exact": m.get(mn.KL_EXACT, 0.0),
                       "phantom_frac_at_eps": m.get(mn.PHANTOM_FRAC, 0.0),
                       "phantom_frac_eps_0.01": small})
    return points


def scale(a: AuditSettings, out: Path, models: list[str] | None = None,
          done: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Audit every model of the size ladder on the same prompts and fit each metric against
    parameter count, with the fit extrapolated to 0.6B and 1.5B parameters. `done`: audits
    already run with these settings, by model name, used instead of running them again."""
    check_run_dir(out)
    models = models or list(testbed.LADDER)
    for name in models:  # a mistyped path is refused before the first model's minutes
        if name not in testbed.SPECS:
            testbed.resolve_model(name)
    with lock_dir(out, "audit --out", empty=True) as lock:
        return _locked_scale(a, out, models, done, lock.created)


def _locked_scale(a: AuditSettings, out: Path, models: list[str],
                   done: dict[str, dict[str, Any]] | None, created: bool) -> dict[str, Any]:
    try:
        points = _ladder_points(a, out, models, done)
    except ParityError:
        # A refusal leaves nothing behind (docs/errors.md): the models audited before it too.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    # The trend of the phantom fraction at the given ε, unless that is 0 everywhere (the small
    # testbed at ε = 0.2): then at ε = 0.01, where it is measurable.
    phantom_eps = a.eps if any(p["phantom_frac_at_eps"] > 0 for p in points) else SMALL_EPS
    for p in points:
        p["phantom_frac"] = (p["phantom_frac_at_eps"] if phantom_eps == a.eps
                             else p["phantom_frac_eps_0.01"])
    fits = {}
    for key in FIT_METRICS:
        f = fit_loglog([p["n_params"] for p in points], [p[key] for p in points])
        if f is not None:
            f["at"] = {f"{x:g}": 10 ** (f["intercept"] + f["slope"] * math.log10(x))
                       for x in EXTRAPOLATE}
            fits[key] = f
    per_axis = {}
    for axis, names in testbed.LADDER_AXES.items():
        pts = [p for p in points if p["model"] in names]
        f = fit_loglog([p["n_params"] for p in pts], [p["beta_abs_mean"] for p in pts])
        if f is not None:
            per_axis[axis] = f["slope"]
    result = {"engine_dtype": a.engine_dtype, "trainer_dtype": a.trainer_dtype, "eps": a.eps,
              "phantom_eps": phantom_eps,
              "samples": a.samples, "points": points, "fits": fits,
              "beta_abs_slope_by_axis": per_axis}
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    scale_report(points, fits, out, phantom_eps)
    return result


def print_scale(result: dict[str, Any]) -> None:
    t = Table(title=f"mismatch against size: {result['engine_dtype']} engine vs "
                    f"{result['trainer_dtype']} trainer, {result['samples']} completions each")
    for col in ("model", "axis", "params", "|beta| mean", "KL k3", "KL exact",
                f"phantom @{result['eps']:g}", "phantom @0.01"):
        t.add_column(col, justify="left" if col in ("model", "axis") else "right")
    for p in result["points"]:
        small = p.get("phantom_frac_eps_0.01")
        t.add_row(Path(p["model"]).name, p["axis"], f"{p['n_params'] / 1e6:.2f}M",
                  f"{p['beta_abs_mean']:.3g}", f"{p['kl_k3']:.3g}", f"{p['kl_exact']:.3g}",
                  f"{p['phantom_frac_at_eps']:.2%}", "" if small is None else f"{small:.2%}")
    f = Table(title="log-log fit against parameter count, extrapolated")
    for col in ("metric", "slope", "at 0.6B", "at 1.5B"):
        f.add_column(col, justify="left" if col == "metric" else "right")
    for key, fit in result["fits"].items():
        at = list(fit["at"].values())
        label = f"{key} (eps={result['phantom_eps']:g})" if key == "phantom_frac" else key
        f.add_row(label, f"{fit['slope']:+.3f}", f"{at[0]:.3g}", f"{at[1]:.3g}")
    console = ui.console(120)
    console.print(t)
    console.print(f)
    if result.get("beta_abs_slope_by_axis"):
        console.print("|beta| slope by axis (log-log, 3 points each): " + ", ".join(
            f"{k} {v:+.3f}" for k, v in result["beta_abs_slope_by_axis"].items()))
