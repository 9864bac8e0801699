"""`parity reproduce --model smollm2-135m`: the seeds' findings on a real pretrained model.

    audits     bf16, fp16 and bf16 with an fp32 LM head against an fp32 trainer    → R1, R2, R3
    sweeps     the seed's sanity check: neg-length-chat (reward −length on short chat
               questions, so that most completions end before the token budget), ε = 0.2, lr 1e-6,
               the engine's log-probs in the ratio (as an asynchronous trainer has them)
                 fp32, bf16-engine, fp16 × 3 seeds; bf16, bf16-shadow, no-clip,
                 recompute × 1 seed                                              → R4–R7
               the same weights rounded to bf16 (`<model>-bf16`): fp32, bf16-engine × 2 → R8
               a larger lr (1e-5): fp32, bf16-engine, fp16 × 1 seed              (table)
    → claims.json, claims.md, plots; every part reused when the command runs again.

The testbed's reproduction (`parity/experiments/reproduce.py`) scales ε to its small β; here the
seeds' own ε = 0.2 applies, because a real model's β is the seeds' size (claim R1 measures it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from parity import metric_names as mn
from parity import testbed
from parity.audit.command import AuditSettings, audit
from parity.config import TASK_DEFAULTS, Config
from parity.experiments import claims as C
from parity.experiments import claims_real as CR
from parity.experiments.reproduce import KL_ROWS
from parity.experiments.sweep import SweepSpec, run_sweep
from parity.files import ensure_writable, read_json
from parity.models.loading import load_policy
from parity.models.pretrained import _bf16_ties
from parity.reports import load_metrics, sweep_report

# Completions shorten from the first steps to the last: a run's `drop` is the mean length over
# its first WINDOW steps minus over its last WINDOW steps.
WINDOW = 3
TASK = "neg-length-chat"


# The seed's sanity check is the neg-length-chat task as parity trains it by default: its model,
# learning rate (TRL's GRPOConfig default, the seed's setting), steps and completion length.
CHAT = TASK_DEFAULTS[TASK]


@dataclass(kw_only=True)
class RealPlan:
    """One real-model reproduction. Every field is the workload of all its runs."""
    model: str = CHAT["model"]
    audit_samples: int = 64         # completions per audit
    # Small steps, many of them: at a fixed lr Adam moves the weights as far per step whatever
    # the batch, so for the time of 10 steps of 16 completions this moves the policy further.
    prompts_per_step: int = 2
    group: int = 4                  # completions per prompt: 8 per step
    max_new_tokens: int = CHAT["max_new_tokens"]
    steps: int = CHAT["steps"]
    lr: float = CHAT["lr"]
    large_lr: float | None = 1e-5   # None: no larger-lr runs
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    control_seeds: list[int] = field(default_factory=lambda: [0, 1])
    main: tuple[str, ...] = ("fp32", "bf16-engine", "fp16")
    fixes: tuple[str, ...] = ("bf16", "bf16-shadow", "no-clip", "recompute")
    audits: tuple[str, ...] = ("bf16", "fp16", "bf16-fp32-head")
    control: bool = True            # the bf16-rounded weights' runs (R8)
    device: str = Config.device     # every audit and run computes there (parity/devices.py)
    engine: str = Config.engine     # every audit and run samples with it (parity/engines)

    @property
    def control_model(self) -> str:
        return f"{self.model}-bf16"


def vllm_plan(**fields: Any) -> RealPlan:
    """The reproduction against vLLM (`--engine vllm`, docs/vllm.md): the bf16 and fp16 audits
    (vLLM computes its head in the engine's dtype, so no fp32-head audit) and the sanity check's
    three recipes on three seeds, at the same workload as parity's engine."""
    return RealPlan(engine="vllm", fixes=(), audits=("bf16", "fp16"), control=False,
                    large_lr=None, **fields)


def real_plan_for(engine: str, **fields: Any) -> tuple[RealPlan, str]:
    """The real-model reproduction `parity reproduce --model M [--engine E]` runs, and its
    default output directory."""
    if engine == "vllm":
        return vllm_plan(**fields), f"reproduce-{fields['model']}-vllm"
    return RealPlan(**fields), f"reproduce-{fields['model']}"


# Each audit of the plan: its engine dtype and whether the LM head is fp32 on both sides.
AUDITS = {"bf16": ("bf16", False), "fp16": ("fp16", False), "bf16-fp32-head": ("bf16", True)}


def _audit(plan: RealPlan, engine: str, head: bool, out: Path, progress: bool) -> dict[str, Any]:
    if (out / "audit.json").is_file():
        return read_json(out / "audit.json", "earlier audit")
    return audit(AuditSettings(model=plan.model, engine=plan.engine, engine_dtype=engine,
                               task=TASK,
                               samples=plan.audit_samples,
                               group=plan.group, max_new_tokens=plan.max_new_tokens,
                               kl_exact_rows=KL_ROWS, lm_head_fp32=head, progress=progress,
                               device=plan.device), out)


def _sweep(plan: RealPlan, out: Path, recipes: list[str], seeds: list[int], model: str,
           lr: float, workers: int, progress: bool) -> dict[str, Any]:
    # The seeds' ε is Config's default clip range, set on every run but no-clip's.
    common = {"steps": plan.steps, "lr": lr,
              "prompts_per_step": plan.prompts_per_step, "samples_per_prompt": plan.group,
              "max_new_tokens": plan.max_new_tokens, "eps_low": Config.eps_low,
              "eps_high": Config.eps_high, "device": plan.device,
              "engine": plan.engine}
    spec = SweepSpec(recipes=recipes, seeds=seeds, tasks=[TASK], models=[model],
                     overrides=common, per_recipe={"no-clip": {"eps_low": None,
                                                               "eps_high": None}},
                     workers=workers)
    return run_sweep(spec, out, progress=progress)


def _runs(summaries: list[dict[str, Any]]) -> dict[str, list[Path]]:
    """Finished run directories by recipe, over several sweeps' summaries."""
    out: dict[str, list[Path]] = {}
    for s in summaries:
        for e in s["runs"].values():
            if e.get("ok") and Path(e["path"], "metrics.jsonl").is_file():
                out.setdefault(e["recipe"], []).append(Path(e["path"]))
    return out


def run_stats(path: Path, window: int = WINDOW, steps: int | None = None) -> dict[str, Any]:
    """What the claims read from one run's metrics.jsonl: its first `steps` steps (all of them
    by default), `window` steps averaged at each end."""
    rows = load_metrics(path / "metrics.jsonl")[:steps]

    def mean(key: str, rs: list[dict]) -> float | None:
        v = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return statistics.fmean(v) if v else None
    first, last = rows[:window], rows[-window:]
    len0, len1 = mean(mn.LEN_MEAN, first), mean(mn.LEN_MEAN, last)
    changed = [r.get(mn.SYNC_CHANGED_FRAC) for r in rows]
    return {"steps": len(rows), "len_first": len0, "len_last": len1,
            "drop": None if len0 is None or len1 is None else len0 - len1,
            "truncated_first": 1 - (mean(mn.EOS_FRAC, first) or 0.0),
            "truncated_last": 1 - (mean(mn.EOS_FRAC, last) or 0.0),
            "beta_first": rows[0].get(mn.BETA_ABS_MEAN),
            "beta_last": mean(mn.BETA_ABS_MEAN, last),
            "kl_first": rows[0].get(mn.KL_K3), "kl_last": mean(mn.KL_K3, last),
            "kl_after_first_sync": mean(mn.KL_K3, rows[1:]),
            "corr_beta_adv": mean(mn.BETA_ADV_CORR, rows),
            "phantom_first": mean(mn.PHANTOM_FRAC, first),
            "changed_first_sync": changed[1] if len(changed) > 1 else None,
            "changed_later": mean(mn.SYNC_CHANGED_FRAC, rows[2:]),
            "step_s": mean(mn.STEP_S, rows)}


class _Phases:
    """Times each part of a reproduction into timing.json. A part's time is the one of the
    invocation that did its work: a rerun that reuses a part in seconds keeps the earlier
    figure, so the total stays the reproduction's cost."""

    def __init__(self, out: Path, model: str, progress: bool):
        self.out, self.model, self.progress = out, model, progress
        self.timing: dict[str, float] = (read_json(out / "timing.json", "earlier timing")
                                         if (out / "timing.json").is_file() else {})

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        took = time.perf_counter() - t0
        if took > 30 or name not in self.timing:
            self.timing[name] = took
        (self.out / "timing.json").write_text(json.dumps(self.timing, indent=1))
        if self.progress:
            print(f"[reproduce {self.model}] {name}: {took / 60:.1f} min", flush=True)


def reproduce_real(plan: RealPlan, out: Path, workers: int = 0, progress: bool = True
                   ) -> dict[str, Any]:
    ensure_writable(out, "reproduce --out")
    out.mkdir(parents=True, exist_ok=True)
    for name in (plan.model, *([plan.control_model] if plan.control else [])):
        testbed.resolve_model(name)             # conversions first, with their own bars
    phase = _Phases(out, plan.model, progress)
    audits = {}
    for key in plan.audits:
        with phase(f"audit {key}"):
            audits[key] = _audit(plan, *AUDITS[key], out / "audits" / key, progress)
    summaries = _sweeps(plan, out / "sweeps", workers, progress, phase)
    t_judge = time.perf_counter()
    runs, claims = _judged(plan, audits, summaries, out)
    seconds = sum(phase.timing.values()) + (time.perf_counter() - t_judge)
    result = {"plan": plan.__dict__ | {"main": list(plan.main), "fixes": list(plan.fixes),
                                       "audits": list(plan.audits)},
              "seconds": seconds, "timing": phase.timing,
              "audits": {k: {m: a["metrics"].get(m) for m in _AUDIT_KEYS}
                         | {"phantom_eps_0.2": _phantom(a, 0.2),
                            "phantom_eps_0.05": _phantom(a, 0.05)}
                         for k, a in audits.items()},
              "runs": runs, "claims": [c.to_dict() for c in claims]}
    (out / "claims.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "claims.md").write_text(markdown(result, claims, plan, out))
    return result


def _sweeps(plan: RealPlan, sw: Path, workers: int, progress: bool, phase: _Phases
            ) -> dict[str, dict[str, Any]]:
    """Every sweep of the plan, by part. Ordered so that an interrupted reproduction has the
    most telling runs first: one seed of every recipe, the bf16-rounded control, the larger lr,
    then the remaining seeds."""
    parts = [("seed0", list(plan.main) + list(plan.fixes), plan.seeds[:1], plan.model, plan.lr),
             *([("bf16-rounded", ["fp32", "bf16-engine"], plan.control_seeds,
                 plan.control_model, plan.lr)] if plan.control else []),
             *([("large-lr", list(plan.main), plan.seeds[:1], plan.model, plan.large_lr)]
               if plan.large_lr else []),
             ("more-seeds", list(plan.main), plan.seeds[1:], plan.model, plan.lr)]
    summaries = {}
    for name, recipes, seeds, model, lr in parts:
        with phase(f"sweep {name}"):
            summaries[name] = _sweep(plan, sw / name, recipes, seeds, model, lr, workers,
                                     progress)
            _prune_checkpoints(sw / name / "runs")
    return summaries


def _judged(plan: RealPlan, audits: dict[str, dict], summaries: dict[str, dict[str, Any]],
            out: Path) -> tuple[dict[str, dict], list[C.Claim]]:
    """Each finished run's figures by sweep (claims.json's `runs`), the plots, and the claims."""
    runs = _runs([summaries["seed0"], summaries["more-seeds"]])
    stats = {r: [run_stats(p) for p in ps] for r, ps in runs.items()}
    rounded = _runs([summaries["bf16-rounded"]] if "bf16-rounded" in summaries else [])
    control = {r: [run_stats(p) for p in ps] for r, ps in rounded.items()}
    large = {r: [run_stats(p) for p in ps]
             for r, ps in _runs([summaries["large-lr"]] if "large-lr" in summaries else []).items()}
    _plots(runs, rounded, out)
    claims = judge(audits, stats, control, _ties(plan.model) if plan.control else None, plan)
    return {"lr": stats, "bf16_rounded": control, "large_lr": large}, claims


def _prune_checkpoints(runs: Path) -> None:
    """A finished run's checkpoint is 1.6 GB on this model and the claims read only
    metrics.jsonl: its files go, its directory stays, so the sweep still sees the run as
    finished and a rerun reuses it. A note says where the weights went."""
    for step in runs.glob("*/checkpoints/step-*"):
        for f in step.iterdir():
            if f.is_dir():
                shutil.rmtree(f)
            else:
                f.unlink()
        (step / "PRUNED.txt").write_text("parity reproduce --model removed this checkpoint's "
                                         "files to save disk; the run cannot be resumed.\n")


_AUDIT_KEYS = (mn.BETA_ABS_MEAN, mn.BETA_ABS_MAX, mn.KL_EXACT,
               mn.KL_K3, mn.KERNEL_GAP_ABS_MEAN, mn.BETA_ADV_CORR)


def _phantom(a: dict[str, Any], eps: float) -> float | None:
    return next((r["phantom_frac"] for r in a["phantom_vs_eps"] if abs(r["eps"] - eps) < 1e-9),
                None)


def _kl(m: dict[str, float]) -> float:
    return m[mn.KL_EXACT] if mn.KL_EXACT in m else m[mn.KL_K3]


def _drops(stats: dict[str, list[dict]]) -> dict[str, list[float]]:
    return {r: [s["drop"] for s in ss if s["drop"] is not None] for r, ss in stats.items()}


def judge(audits: dict[str, dict], stats: dict[str, list[dict]],
          control: dict[str, list[dict]], ties: float | None, plan: RealPlan) -> list[C.Claim]:
    """Measured numbers → claims, those the plan has the measurements for. Pure apart from
    reading what it is given."""
    b, f = (audits[k]["metrics"] for k in ("bf16", "fp16"))
    claims = [CR.real_gap(b[mn.BETA_ABS_MEAN], _phantom(audits["bf16"], 0.2), plan.model),
              C.fp16_shrinks_gap(_kl(b), _kl(f), b[mn.BETA_ABS_MEAN],
                                 f[mn.BETA_ABS_MEAN])]
    claims[1].id = "R2"
    if "bf16-fp32-head" in audits:
        h = audits["bf16-fp32-head"]["metrics"]
        claims.append(CR.fp32_head_helps(_kl(b), _kl(h), b[mn.BETA_ABS_MEAN],
                                         h[mn.BETA_ABS_MEAN]))
    drops = _drops(stats)
    lag = CR.sanity_check(drops, plan.lr, plan.steps)
    claims += [lag, *([CR.fixes_on_real_model(drops, lag)] if plan.fixes else []),
               CR.fp16_like_fp32(drops)]
    bf = stats.get("bf16-engine", [])
    claims.append(CR.gap_grows([s["kl_first"] for s in bf if s["kl_last"] is not None],
                              [s["kl_last"] for s in bf if s["kl_last"] is not None],
                              "KL(μ‖π) (k3)", "R7"))
    if plan.control:
        claims.append(_ties_claim(ties, bf, control.get("bf16-engine", [])))
    return claims


def _ties_claim(ties: float | None, bf: list[dict], cb: list[dict]) -> C.Claim:
    """R8, from the bf16-engine runs on the dequantised weights and on the bf16-rounded ones."""
    def first_sync(ss: list[dict]) -> float | None:
        v = [s["changed_first_sync"] for s in ss if s["changed_first_sync"] is not None]
        return statistics.fmean(v) if v else None

    def growth(ss: list[dict]) -> list[float]:
        return [s["kl_after_first_sync"] / s["kl_first"] for s in ss
                if s["kl_first"] and s["kl_after_first_sync"] is not None]
    return CR.ties_make_the_gap_grow(
        ties, {"dequantised": first_sync(bf), "bf16-rounded": first_sync(cb)},
        {"dequantised": growth(bf), "bf16-rounded": growth(cb)})


def _ties(model: str) -> float:
    """Share of the model's weights exactly halfway between two bf16 values."""
    return _bf16_ties(load_policy(testbed.resolve_model(model))[0])


PANELS = [(mn.LEN_MEAN, "completion length"),
          (mn.EOS_FRAC, "completions ending in EOS"),
          (mn.BETA_ABS_MEAN, "|β| token mean"), (mn.KL_K3, "KL(μ‖π) k3"),
          (mn.PHANTOM_FRAC, "phantom-clipped fraction"),
          (mn.SYNC_CHANGED_FRAC, "bf16/fp16 weights changed at sync")]


def _plots(runs: dict[str, list[Path]], control: dict[str, list[Path]], out: Path) -> None:
    groups = dict(runs) | {f"{r} (bf16-rounded weights)": ps for r, ps in control.items()}
    sweep_report(groups, out / "plots", PANELS)


def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _g(v: Any, fmt: str) -> str:
    return "missing" if v is None else format(v, fmt)


VLLM_NOTE = (" Every audit and run samples with vLLM's engine (`--engine vllm`); the trainer and "
             "its shadow forward are parity's own.")


def markdown(result: dict[str, Any], claims: list[C.Claim], plan: RealPlan, out: Path) -> str:
    vllm = plan.engine == "vllm"
    pre = (f"`parity reproduce --model {plan.model}{' --engine vllm' if vllm else ''}`: "
           f"{result['seconds'] / 60:.1f} min on this machine (2 CPU cores)."
           f"{VLLM_NOTE if vllm else ''} {TASK} (reward −length on short chat questions), "
           f"{plan.prompts_per_step} prompts × {plan.group} completions of at most "
           f"{plan.max_new_tokens} tokens per step, {plan.steps} steps, ε = {Config.eps_low:g}, "
           f"lr {plan.lr:g}, the engine's log-probs in the ratio. Seeds {plan.seeds} for "
           f"{', '.join(plan.main)}"
           + (f"; seed {plan.seeds[0]} for {', '.join(plan.fixes)}" if plan.fixes else "")
           + ". `claims.json` has every measured number.")
    md = C.to_markdown(claims, f"Claims of the seeds, measured on {plan.model}", pre)
    md += "\n## Audits (an fp32 trainer against each engine)\n\n"
    md += _table([[k, _g(a[mn.BETA_ABS_MEAN], ".3g"), _g(a[mn.BETA_ABS_MAX], ".3g"),
                   _g(a[mn.KL_EXACT], ".2g"), _g(a["phantom_eps_0.2"], ".2%"),
                   _g(a["phantom_eps_0.05"], ".2%"), _g(a[mn.KERNEL_GAP_ABS_MEAN], ".2g")]
                  for k, a in result["audits"].items()],
                  ["engine", "|β| mean", "|β| max", "KL(μ‖π) exact", "phantom ε=0.2",
                   "phantom ε=0.05", "shadow kernel gap"])
    sections = [("Runs at lr " + format(plan.lr, "g"), "lr")]
    if plan.control:
        sections.append(("The same weights rounded to bf16, lr " + format(plan.lr, "g"),
                         "bf16_rounded"))
    if plan.large_lr:
        sections.append(("A larger lr, " + format(plan.large_lr, "g"), "large_lr"))
    for title, key in sections:
        rows = []
        for recipe, ss in result["runs"][key].items():
            for i, s in enumerate(ss):
                rows.append([recipe, str(i), _g(s["len_first"], ".1f"), _g(s["len_last"], ".1f"),
                             _g(s["drop"], ".1f"), _g(s["truncated_first"], ".0%"),
                             _g(s["truncated_last"], ".0%"), _g(s["beta_first"], ".3g"),
                             _g(s["beta_last"], ".3g"), _g(s["kl_first"], ".2g"),
                             _g(s["kl_last"], ".2g"), _g(s["corr_beta_adv"], "+.3f"),
                             _g(s["changed_first_sync"], ".2%"), _g(s["changed_later"], ".2%"),
                             _g(s["step_s"], ".0f")])
        md += f"\n## {title}\n\n" + (_table(rows, [
            "recipe", "run", "length first", "length last", "drop", "truncated first",
            "truncated last", "|β| first", "|β| last", "KL first", "KL last", "corr(β, A)",
            "changed at 1st sync", "changed later", "s/step"]) if rows else "No finished runs.\n")
    md += (f"\nFirst and last: the mean over the first and the last {WINDOW} steps (|β| and KL "
           f"first: step 1 alone). Truncated: completions that reached {plan.max_new_tokens} "
           f"tokens without EOS.\n")
    if (out / "plots" / "sweep.png").is_file():
        md += ("\n### Per step, one line per recipe (mean over seeds, band from lowest to "
               "highest)\n\n![per step](plots/sweep.png)\n")
    return md
