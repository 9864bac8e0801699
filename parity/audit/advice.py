"""What an audit's figures mean and what to do about them (docs/diagnostics.md, What to do).

An audit measures the gap between the engine's log-probs ℓ_μ and the trainer's ℓ_π. Here that
gap is put beside reference points (the seeds' figures, verl's guidance, and what parity
measured for its own engine and for vLLM's on the same model), and a recipe is recommended from
what was measured: the phantom-clipped share at the user's ε, the shadow's kernel gap against
the engine, and whether the model fits fp16 (`parity fp16-check`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rich.table import Table

from parity import metric_names as mn
from parity.audit import locate
from parity.config import Config
from parity.errors import ParityError
from parity.files import read_json

# The phantom-clipped share at the user's ε from which numerics are worth a fix: the share the
# audit's verdict has always flagged. Below it, clipping is the policy's own.
PHANTOM_FIX = 0.01
# bf16-shadow takes β out of the ratio only where the shadow reproduces the engine: its kernel
# gap |α| at θ = θ_old must be small against the gap |ℓ_π − ℓ_μ| it is meant to remove.
KERNEL_GAP_SHARE = 0.1
# verl's guidance for `training/rollout_probs_diff_mean`, parity's `mismatch/prob_diff_abs_mean`
# (mean |π − μ| per token): below 0.005 normal, above 0.01 an engine precision problem
# (docs/diagnostics.md, What to do).
VERL_NORMAL, VERL_PROBLEM = 0.005, 0.01

REAL_MODEL = "smollm2-135m"   # the built-in pretrained model the vLLM rows were measured on

# The figures a reference row and the user's audit are compared on, with their labels.
COMPARED = ((mn.LOG_RATIO_ABS_MEAN, "|ℓ_π − ℓ_μ| per token"),
            (mn.PROB_DIFF_ABS_MEAN, "|π − μ| per token"),
            (mn.KL_K3, "KL k3"),
            (mn.PHANTOM_AT_EPS.format(eps=0.2), "phantom-clipped at ε=0.2"),
            (mn.PHANTOM_AT_EPS.format(eps=0.05), "phantom-clipped at ε=0.05"),
            (mn.ALPHA_ABS_MEAN, "parity shadow's kernel gap |α|"))

SHORT = ("|Δℓ|", "|Δp|", "KL k3", "phantom ε=0.2", "phantom ε=0.05", "|α|")

# The published figures, as docs/diagnostics.md quotes them with their sources.
PUBLISHED = [
    {"label": "seeds: asynchronous GRPO, vLLM bf16 engine, fp32 trainer", "model": "Qwen3-0.6B",
     "values": {mn.LOG_RATIO_ABS_MEAN: "1e-2 to 1e-1 (|β|)",
                mn.PHANTOM_AT_EPS.format(eps=0.2): "about 18%, early in training"},
     "source": "docs/design.md, The seeds"},
    {"label": "the FP16 paper: fp16 engine and trainer against bf16", "model": "1.5B models",
     "values": {mn.KL_K3: "KL(μ‖π) about 24× lower in fp16"},
     "source": "docs/design.md, The seeds"},
    {"label": "verl's guidance (rollout_probs_diff_mean)", "model": "any",
     "values": {mn.PROB_DIFF_ABS_MEAN:
                f"below {VERL_NORMAL:g} normal; above {VERL_PROBLEM:g} an engine precision "
                f"problem"},
     "source": "docs/diagnostics.md, What to do"},
]

# Each fix, what it changes and what it costs (docs/design.md, Recipes; measured costs:
# docs/performance.md and docs/diagnostics.md, What it costs).
FIXES = {
    "bf16-shadow": "β out of the ratio by a shadow forward of the engine's weights in engine "
                   "precision: one no-grad forward per update, at the engine's precision",
    "recompute": "β out of the ratio by the trainer's own old log-probs (decoupled PPO): one "
                 "no-grad forward per step, at the trainer's precision",
    "tis": f"recompute, plus a truncated importance weight min(ρ, {Config.is_cap:g}) for the "
           f"engine's remaining off-policy gap: the recompute forward, nothing more",
    "fp16": "the gap itself about 8× smaller (fp16 engine and trainer, loss scaling): fp16 "
            "arithmetic on both sides, as fast as bf16 on GPUs, slower on CPUs without fp16 "
            "units",
    "wide-eps / no-clip": "a looser trust region: free, but it loosens it for the policy's "
                          "own moves too, so it is not a fix for numerics",
}


# The same quantities under the names other RL libraries log them, so a user can read parity's
# figures against the dashboards they already have (docs/diagnostics.md, What to do, gives each
# one's definition and where it is defined). None: that library logs no such quantity.
# Δ = ℓ_π − ℓ_μ per token; ℓ_π is the trainer's old log-prob where the library recomputes one.
METRIC_NAMES = [
    {"parity": mn.LOG_RATIO_ABS_MEAN, "quantity": "token mean of |Δ|",
     "trl": "sampling/sampling_logp_difference/mean", "verl": None,
     "slime": "train/train_rollout_logprob_abs_diff"},
    {"parity": mn.LOG_RATIO_ABS_MAX, "quantity": "max |Δ|",
     "trl": "sampling/sampling_logp_difference/max", "verl": None, "slime": None},
    {"parity": mn.PROB_DIFF_ABS_MEAN, "quantity": "token mean of |exp ℓ_π − exp ℓ_μ|",
     "trl": None, "verl": "training/rollout_probs_diff_mean", "slime": None},
    {"parity": mn.KL_K1, "quantity": "token mean of ℓ_μ − ℓ_π",
     "trl": None, "verl": "rollout_corr/kl", "slime": "train/mis_kl"},
    {"parity": mn.KL_K3, "quantity": "token mean of exp(Δ) − Δ − 1",
     "trl": None, "verl": "rollout_corr/k3_kl", "slime": "train/mis_k3_kl"},
]


@dataclass(kw_only=True)
class Advice:
    """The recommendation an audit ends with (audit.json's `advice`)."""
    status: str                       # fine | fix
    headline: str                     # one line: what to do
    recipe: str | None                # the recipe to switch to; None: keep the setup
    reasons: list[str] = field(default_factory=list)
    options: list[dict[str, str]] = field(default_factory=list)   # fix, fits, why, cost
    references: list[dict[str, Any]] = field(default_factory=list)


def reference_points(model: str | None = None) -> list[dict[str, Any]]:
    """parity's measured reference rows (built by scripts/reference_points.py from the committed
    audits), those on `model` first; the published figures after them."""
    try:
        text = resources.files("parity").joinpath("data/reference_points.json").read_text()
        rows = json.loads(text)["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise ParityError(f"parity's reference points are unreadable ({e}): reinstall parity"
                          ) from None
    name = Path(model).name if model else None
    same = [r for r in rows if r["model"] == name]
    # The real model's rows always: they are the ones with vLLM as the engine.
    real = [r for r in rows if r["model"] == REAL_MODEL and r["model"] != name]
    return [*same, *real, *PUBLISHED]


def fp16_fit(path: str | None) -> tuple[bool | None, str]:
    """Whether `parity fp16-check`'s verdict (its fp16_check.json) lets the model train in fp16;
    None where no check was given."""
    if not path:
        return None, "not checked (run `parity fp16-check --model MODEL`, then pass " \
                     "--fp16-check OUT/fp16_check.json)"
    p = Path(path)
    r = read_json(p / "fp16_check.json" if p.is_dir() else p, "fp16 check")
    v = r.get("verdict") if isinstance(r, dict) else None
    if not isinstance(v, dict) or not {"inference", "training"} <= v.keys():
        raise ParityError(f"{path}: not a `parity fp16-check` result (no verdict.inference/"
                          f"training)")
    ok = v["inference"] == "OK" and v["training"] == "OK"
    return ok, f"fp16-check: inference {v['inference']}, training {v['training']}"


def _figure(m: dict[str, float], table: list[dict[str, float]], key: str) -> float | None:
    if key.startswith(mn.prefix(mn.PHANTOM_AT_EPS)):
        eps = float(key.split("@")[1])
        return next((r["phantom_frac"] for r in table if abs(r["eps"] - eps) < 1e-12), None)
    return m.get(key)


def yours(result: dict[str, Any]) -> dict[str, float | None]:
    """The audit's figures under the names the reference rows use."""
    return {k: _figure(result["metrics"], result["phantom_vs_eps"], k) for k, _ in COMPARED}


def advise(result: dict[str, Any], fp16_check: str | None = None) -> Advice:
    """The recommendation for an audit's result (audit.json's content without `advice`)."""
    m, eps = result["metrics"], result["eps"]
    phantom = m.get(mn.PHANTOM_FRAC, 0.0)
    gap = m.get(mn.LOG_RATIO_ABS_MEAN, m.get(mn.BETA_ABS_MEAN))
    alpha = m.get(mn.ALPHA_ABS_MEAN)
    pdiff = m.get(mn.PROB_DIFF_ABS_MEAN)
    fits16, fp16_note = fp16_fit(fp16_check)
    refs = reference_points(result.get("model"))
    reasons = [f"numerics alone clip {phantom:.2%} of tokens at your ε = {eps:g} (a fix is worth "
               f"it from {PHANTOM_FIX:.0%})"]
    if pdiff is not None:
        verl = ("normal" if pdiff < VERL_NORMAL else "an engine precision problem"
                if pdiff > VERL_PROBLEM else "between normal and a problem")
        reasons.append(f"mean |π − μ| = {pdiff:.3g} per token: {verl} by verl's guidance "
                       f"(< {VERL_NORMAL:g} normal, > {VERL_PROBLEM:g} a problem)")
    shadow_ok = alpha is not None and gap is not None and gap > 0 and \
        alpha <= KERNEL_GAP_SHARE * gap
    if alpha is not None and gap:
        reasons.append(f"parity's shadow reproduces the engine to |α| = {alpha:.3g} per token, "
                       f"{alpha / gap:.0%} of the gap: bf16-shadow "
                       + ("is exact enough" if shadow_ok
                          else "would carry as much noise as it removes"))
    if result["engine_dtype"] == "fp16":
        fits16, fp16_note = True, "the engine already runs fp16"
    reasons.append(f"fp16: {fp16_note}")
    reasons += locate.advice(result)

    options = [
        {"fix": "bf16-shadow", "fits": "yes" if shadow_ok else "no",
         "why": (f"kernel gap |α| {alpha:.3g} ≤ {KERNEL_GAP_SHARE:.0%} of the gap"
                 if shadow_ok else "the shadow's kernels are not the engine's "
                 "(with --engine vllm, shadow_kernels=scored has the engine score it)"
                 if alpha is not None else "no kernel gap measured"),
         "cost": FIXES["bf16-shadow"]},
        {"fix": "recompute", "fits": "yes", "why": "exact whatever the engine's kernels",
         "cost": FIXES["recompute"]},
        {"fix": "tis", "fits": "yes" if pdiff is not None and pdiff > VERL_PROBLEM else "optional",
         "why": "corrects the off-policy gap recompute leaves in the gradient; worth it where "
                "verl's guidance calls the gap a problem", "cost": FIXES["tis"]},
        {"fix": "fp16", "fits": {True: "yes", False: "no", None: "unknown"}[fits16],
         "why": fp16_note, "cost": FIXES["fp16"]},
        {"fix": "wide-eps / no-clip", "fits": "no", "why": "not a fix for numerics",
         "cost": FIXES["wide-eps / no-clip"]}]

    if phantom < PHANTOM_FIX:
        recipe, status = None, "fine"
        headline = (f"no fix needed at ε = {eps:g}: numerics clip {phantom:.2%} of tokens; keep "
                    f"your recipe and watch clip/phantom_frac as training goes on")
    else:
        status = "fix"
        recipe = "bf16-shadow" if shadow_ok else (
            "tis" if pdiff is not None and pdiff > VERL_PROBLEM else "recompute")
        also = " (or fp16, which the model fits)" if fits16 and recipe != "fp16" else ""
        headline = (f"take β out of the ratio: numerics clip {phantom:.2%} of tokens at "
                    f"ε = {eps:g}; switch to --recipe {recipe}{also}")
    return Advice(status=status, headline=headline, recipe=recipe, reasons=reasons,
                  options=options, references=refs)


def as_json(a: Advice) -> dict[str, Any]:
    return asdict(a)


def _cell(key: str, v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    return f"{v:.2%}" if key.startswith(mn.CLIP) else f"{v:.3g}"


def reference_table(result: dict[str, Any], a: Advice) -> tuple[list[str], list[list[str]]]:
    """The user's figures in the first row, the reference rows below (header, rows)."""
    head = ["", "model", *[label for _, label in COMPARED], "source"]
    mine = yours(result)
    rows = [["your audit", str(result.get("model")),
             *[_cell(k, mine[k]) for k, _ in COMPARED], "this audit"]]
    for r in a.references:
        rows.append([r["label"], r["model"], *[_cell(k, r["values"].get(k)) for k, _ in COMPARED],
                     r["source"]])
    return head, rows


def what_to_do(result: dict[str, Any]) -> dict[str, Any]:
    """The advice as a report shows it: a headline, its reasons and three tables (title,
    header, rows, caption)."""
    a = Advice(**result["advice"])
    head, rows = reference_table(result, a)
    opts = [[o["fix"], o["fits"], o["why"], o["cost"]] for o in a.options]
    names = [[n["parity"], n["quantity"], n["trl"] or "—", n["verl"] or "—", n["slime"] or "—"]
             for n in METRIC_NAMES]
    return {"headline": a.headline, "reasons": a.reasons, "tables": [
        ("Your figures beside the reference points", head, rows,
         "All against an fp32 trainer; the measured rows on the same task settings as their "
         "source. Reference points and their sources: docs/diagnostics.md, What to do."),
        ("The fixes", ["recipe", "fits here", "why", "what it changes and costs"], opts, ""),
        ("The same metrics in other libraries", ["parity", "quantity", "TRL", "verl", "slime"],
         names, "Δ = ℓ_π − ℓ_μ per token; a library that recomputes old log-probs has them "
                "as ℓ_π. —: not logged there.")]}


def print_advice(result: dict[str, Any], console: Any) -> None:
    """The advice under the audit's table: what to do, why, and the measured reference points
    (the published ones in a line each)."""
    w = what_to_do(result)
    console.print(f"[bold]what to do:[/bold] {w['headline']}", highlight=False)
    for r in w["reasons"]:
        console.print(f"  - {r}", highlight=False)
    _, _, rows, _ = w["tables"][0]
    t = Table(title="beside parity's measurements (fp32 trainer)", title_justify="left")
    for h in ("", "model", *SHORT):
        t.add_column(h, justify="left" if h in ("", "model") else "right")
    measured = rows[:1 + len(result["advice"]["references"]) - len(PUBLISHED)]
    for row in measured:
        t.add_row(*row[:-1])
    console.print(t)
    for p in PUBLISHED:
        figs = "; ".join(f"{dict(COMPARED)[k]}: {v}" for k, v in p["values"].items())
        console.print(f"  {p['label']} ({p['model']}): {figs}", highlight=False)
    console.print("the fixes, the sources and the same metrics under TRL's, verl's and slime's "
                  "names: report.html and docs/diagnostics.md (What to do)", highlight=False)
