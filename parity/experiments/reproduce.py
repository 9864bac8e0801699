"""`parity reproduce [--quick]`: the seeds' findings measured on the CPU testbed.

    audits       bf16 and fp16 engines against an fp32 trainer     → claims 1a, 1b, 2a, 2b, 4
    scale        the same audit across model sizes                 → claim 1c
    sweeps       recipes × seeds on neg-length (full) and arith, each at the ε where its
                 own model's bf16 engine clips the seeds' 18% at sync → claims 3, 5a, 5b, 7
    long horizon fp32, tis and seq-mis on arith trained on past the sweep      → claim 5b-arith
    small lr     weight changes at sync per engine dtype           → claim 6
    drivers      |β| against depth, width, vocabulary, position and temperature → claim 10
    → claims.json, claims.md, the table printed

Every part writes into its own directory and is reused when the command runs again, so an
interrupted reproduction continues where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq
from rich.table import Table

from parity import metric_names as mn
from parity import testbed, ui
from parity.audit.command import audit
from parity.audit.scale import fit_loglog, scale
from parity.config import TASK_DEFAULTS, AuditSettings, Config
from parity.errors import ParityError
from parity.experiments import claims as C
from parity.experiments.claims_moe import replay_closes_the_routing_gap
from parity.experiments.sweep import SweepSpec, run_sweep
from parity.files import ensure_writable, read_json
from parity.objectives import OBJECTIVES
from parity.reports import load_metrics

MAIN_RECIPES = ["fp32", "bf16-engine", "bf16-shadow", "no-clip", "wide-eps", "recompute", "tis",
                "seq-mis"]
# The FP16 paper's headline (one precision on both sides) where the stall shows: arith.
ARITH_RECIPES = MAIN_RECIPES + ["fp16", "bf16"]
# The stall and the two fixes of claim 3: what the quick run can afford of arith.
STALL_RECIPES = ["fp32", "bf16-engine", "bf16-shadow", "no-clip"]
# Claim 9: the FP16 paper's algorithms besides GRPO, and the precisions it compares them in.
OTHER_ALGORITHMS = ["gspo", "pg-is", "ppo-value", "online-dpo"]
ALGORITHM_RECIPES = ["fp32", "bf16-engine", "fp16"]
# Claim 3-async: the seeds' asynchronous regime, an engine one optimizer step stale and two
# minibatches per rollout, so the policy has moved when most tokens are scored (α ≠ 0).
ASYNC = {"async_engine": True, "max_staleness": 1, "minibatches": 2}
ASYNC_SETTING = "engine 1 step stale, 2 minibatches"
ASYNC_RECIPES = ["fp32", "bf16-engine", "bf16-shadow", "recompute", "tis"]
# Claim 11: LoRA adapters of rank 8 (alpha 16) at ten times the learning rate a LoRA run needs
# to learn arith as fast as a full fine-tune (docs/lora.md), the engine seeing them merged.
LORA = {"lora_rank": 8, "lr": 1e-3}
LORA_SETTING = "LoRA rank 8, alpha 16, lr 1e-3, merged into the engine's weights"
LORA_RECIPES = ["fp32", "bf16-engine", "fp16"]
# Claim 5b-arith: the FP16 paper sees TIS degrade late in training, sequence-MIS stay stable;
# these arith runs go on from the sweep's last step to the plan's horizon.
HORIZON_RECIPES = ["fp32", "tis", "seq-mis"]


@dataclass(kw_only=True)
class ReproductionPlan:
    """One testbed reproduction: what each of its parts audits and trains, and for how long."""
    name: str
    audit_model: str
    samples: int
    scale_models: list[str]
    sweep_model: str
    seeds: list[int]
    steps: int                                # neg-length steps; 0: no neg-length sweep
    arith_steps: int = 0                      # 0: no arith sweep
    arith_seeds: list[int] = field(default_factory=list)
    arith_recipes: list[str] = field(default_factory=lambda: list(ARITH_RECIPES))
    arith_model: str = testbed.DEFAULT_ARITH
    # Other objectives trained on arith with fp32, bf16-engine and fp16 (claim 9); GRPO's
    # token PPO-clip comes from the arith sweep itself.
    algorithms: list[str] = field(default_factory=list)
    algorithm_seeds: list[int] = field(default_factory=list)
    async_seeds: list[int] = field(default_factory=list)   # claim 3-async; [] skips it
    # its recipes: fp32, bf16-engine and any of the fixes (claims.async_stall_and_fixes)
    async_recipes: list[str] = field(default_factory=lambda: list(ASYNC_RECIPES))
    lora_seeds: list[int] = field(default_factory=list)    # claim 11 (LoRA); [] skips it
    # claim 3-scored: bf16-shadow with the shadow the engine scores itself; [] skips it
    scored_seeds: list[int] = field(default_factory=list)
    horizon_steps: int = 0    # claim 5b-arith's horizon (> arith_steps); 0: the sweep's own
    drivers: bool = False     # claim 10: what makes β large
    moe_model: str = "moe-xs"  # claim 12, routing replay, one step without and with; "": none
    moe_completions: tuple[int, int, int] = (16, 8, 32)   # its prompts, samples each, tokens
    long_tokens: int = 192    # completions of its position audit (the testbed's 256 positions)
    small_lr: float = 3e-6    # where a bf16 cast barely changes per step (claim 6)
    small_lr_steps: int = 6
    # neg-length's audits sample as long completions as it trains with
    audit_tokens: int = TASK_DEFAULTS["neg-length"]["max_new_tokens"]
    device: str = Config.device   # every audit and run computes there (parity/devices.py)
    engine: str = Config.engine   # every audit and run samples with it (docs/design.md, engines)


# The quick run spends its minutes on the headline, the arith stall and two fixes, rather than
# on neg-length, where nothing lags (the full run has both).
QUICK = ReproductionPlan(name="quick", audit_model=testbed.DEFAULT_TEXT, samples=128,
                         scale_models=[testbed.TEST_TEXT, testbed.DEFAULT_TEXT],
                         sweep_model=testbed.DEFAULT_TEXT, seeds=[], steps=0, arith_steps=400,
                         arith_seeds=[0, 1], arith_recipes=STALL_RECIPES)
# The full run must stay within 90 minutes on 2 cores. Claim 5b-arith's horizon (fp32, tis and
# seq-mis trained on to 800 steps: 8.1 minutes in docs/reproduce/timing.json) was paid for with
# a seed each of the neg-length sweep (where nothing lags) and the LoRA sweep.
# The arith stall and its fixes against a real engine, vLLM's CPU build, at ε calibrated on
# vLLM's own β; the text audits against it. Not part of the full run, which must stay within
# 90 minutes on 2 cores: `parity reproduce --engine vllm` (docs/vllm.md).
VLLM_RECIPES = ["fp32", "bf16-engine", "bf16-shadow", "no-clip", "recompute", "tis", "fp16"]
VLLM = ReproductionPlan(name="vllm", audit_model=testbed.DEFAULT_TEXT, samples=128,
                        scale_models=[], sweep_model=testbed.DEFAULT_TEXT, seeds=[], steps=0,
                        arith_steps=400, arith_seeds=[0, 1, 2], arith_recipes=VLLM_RECIPES,
                        scored_seeds=[0, 1, 2], engine="vllm")
FULL = ReproductionPlan(name="full", audit_model=testbed.LARGEST, samples=512,
                        scale_models=list(testbed.LADDER), sweep_model=testbed.DEFAULT_TEXT,
                        seeds=[0, 1], steps=30, arith_steps=400, arith_seeds=[0, 1, 2],
                        algorithms=OTHER_ALGORITHMS, algorithm_seeds=[0, 1], async_seeds=[0, 1],
                        drivers=True, lora_seeds=[0, 1], horizon_steps=800)


def plan_for(engine: str, quick: bool) -> tuple[ReproductionPlan, str]:
    """The testbed reproduction `parity reproduce [--quick] [--engine E]` runs, and its default
    output directory. vLLM's has a plan of its own, with no quick form."""
    if engine == VLLM.engine:
        if quick:
            raise ParityError("reproduce: --engine vllm runs its own plan (docs/vllm.md); drop "
                              "--quick")
        return VLLM, "reproduce-vllm"
    return (QUICK, "reproduce-quick") if quick else (FULL, "reproduce")


def eps_at_share(table: list[dict[str, float]], target: float, key: str = "phantom_frac"
                 ) -> float | None:
    """The ε at which the audit's fraction `key` falls to `target`, interpolated in log ε
    between the audit's sweep points (the fraction falls as ε widens); None if never that high."""
    pts = sorted((r["eps"], r[key]) for r in table)
    for (e0, p0), (e1, p1) in zip(pts, pts[1:]):
        if p0 >= target >= p1 and p0 != p1:
            t = (p0 - target) / (p0 - p1)
            return math.exp(math.log(e0) + t * (math.log(e1) - math.log(e0)))
    return None


def phantom_at(table: list[dict[str, float]], eps: float) -> float:
    """Phantom fraction at ε, interpolated in log ε (clamped to the sweep's ends)."""
    pts = sorted((r["eps"], r["phantom_frac"]) for r in table)
    if eps <= pts[0][0]:
        return pts[0][1]
    for (e0, p0), (e1, p1) in zip(pts, pts[1:]):
        if e0 <= eps <= e1:
            t = (math.log(eps) - math.log(e0)) / (math.log(e1) - math.log(e0))
            return p0 + t * (p1 - p0)
    return pts[-1][1]


# Distributions kept per audit batch for the exact KL: the published claims were measured with 8.
KL_ROWS = 8


def _audit(plan: ReproductionPlan, engine: str, out: Path, progress: bool,
           model: str | None = None, task: str = "neg-length", tokens: int | None = None,
           temperature: float = AuditSettings.temperature) -> dict[str, Any]:
    if (out / "audit.json").is_file():
        return read_json(out / "audit.json", "earlier audit")
    # neg-length at the length it trains with; a built-in task's own length otherwise
    length = ({"max_new_tokens": tokens or plan.audit_tokens} if task == "neg-length" else {})
    return audit(AuditSettings(model=model or plan.audit_model, engine=plan.engine,
                               engine_dtype=engine, task=task,
                               samples=plan.samples, kl_exact_rows=KL_ROWS, progress=progress,
                               temperature=temperature, device=plan.device, **length), out)


# Where an audit never clips 18% at sync (a model whose β is tiny), the sweep runs at this ε and
# claims.md says that it is not calibrated.
FALLBACK_EPS = 0.005


def calibrated_eps(audit: dict[str, Any]) -> tuple[float, bool]:
    """The clip range at which this audit's bf16 engine clips the seeds' 18% of tokens at sync
    (two significant digits), and whether the audit reached 18% at all.

    An audit is taken at θ = θ_old, so every token it clips is clipped by numerics: the seeds'
    phantom share. With shared kernels that is parity's phantom fraction exactly (α = 0). A real
    engine's kernels differ from any shadow's, which then moves part of the engine's own gap
    into α and out of the phantom count; calibrating on the phantom count would calibrate on
    the shadow, not on the engine's β."""
    eps = eps_at_share(audit["phantom_vs_eps"], C.SEED_PHANTOM, key="clip_frac")
    return (float(f"{eps:.2g}"), True) if eps is not None else (FALLBACK_EPS, False)


def _scale(plan: ReproductionPlan, out: Path, progress: bool, done: dict[str, dict]
           ) -> dict[str, Any]:
    if (out / "scale.json").is_file():
        return read_json(out / "scale.json", "earlier scale audit")
    return scale(AuditSettings(model="ladder", task="neg-length", samples=plan.samples,
                               max_new_tokens=plan.audit_tokens, kl_exact_rows=KL_ROWS,
                               progress=progress, device=plan.device), out,
                 plan.scale_models, done)


def _sweep(plan: ReproductionPlan, out: Path, recipes: list[str], seeds: list[int], task: str,
           model: str, overrides: dict[str, Any], workers: int, progress: bool,
           per_recipe: dict[str, dict[str, Any]] | None = None,
           continue_from: Path | None = None) -> dict[str, Any]:
    spec = SweepSpec(recipes=recipes, seeds=seeds, tasks=[task], models=[model],
                     overrides={**overrides, "device": plan.device, "engine": plan.engine},
                     per_recipe=per_recipe or {},
                     workers=workers, continue_from=continue_from)
    return run_sweep(spec, out, progress=progress)


def scaled_clip(eps: float) -> dict[str, dict[str, Any]]:
    """Each recipe's clip range at the scaled ε: no-clip keeps none, wide-eps widens the upper
    side by DAPO's 0.28 / 0.2."""
    return {"no-clip": {"eps_low": None, "eps_high": None},
            "wide-eps": {"eps_low": eps, "eps_high": round(1.4 * eps, 6)}}


# Claim 10: each axis the testbed varies, extrapolated to the seeds' model's value of it
# (Qwen3-0.6B: 28 layers, width 1024, vocabulary 151,936; completions of about a thousand tokens)
# with the others held at the testbed's; and the sharpness of the distribution (temperature).
SEED_MODEL_AXES = {"depth": 28, "width": 1024, "vocab": 151_936, "position": 1024}
DRIVER_TEMPERATURES = [0.7, 1.4]        # beside the audits' 1.0
POSITION_BINS = [0, 8, 32, 96, 192]


def beta_by_position(tokens: Path, bins: list[int]) -> list[dict[str, float]]:
    """Mean |β| = |ℓ_μ − ℓ_π| of an audit's tokens by completion position, in [lo, hi) bins."""
    t = pq.read_table(tokens, columns=["position", "engine_logprob", "trainer_logprob"])
    pos = t["position"].to_pylist()
    b = [abs(x - y) for x, y in zip(t["engine_logprob"].to_pylist(),
                                     t["trainer_logprob"].to_pylist())]
    out = []
    for lo, hi in zip(bins, bins[1:]):
        v = [x for p, x in zip(pos, b) if lo <= p < hi]
        if v:
            out.append({"lo": lo, "hi": hi, "tokens": len(v), "beta_abs": sum(v) / len(v)})
    return out


def extrapolate(xy: list[tuple[float, float]], target: float) -> dict[str, Any]:
    """|β| at `target` along the log-log fit of the measured (axis value, |β|) points."""
    fit = fit_loglog([x for x, _ in xy], [y for _, y in xy])
    at = None if fit is None else 10 ** (fit["intercept"] + fit["slope"] * math.log10(target))
    return {"points": [list(p) for p in xy], "target": target,
            "slope": fit and fit["slope"], "at_target": at}


def beta_drivers(sc: dict[str, Any], positions: list[dict[str, float]]) -> dict[str, dict]:
    """Each ladder axis (its models' depth, width or vocabulary against their |β|) and the
    completion position, extrapolated to the seeds' model."""
    value = {"depth": "n_layer", "width": "d_model", "vocab": "vocab_size"}
    beta = {p["model"]: p["beta_abs_mean"] for p in sc.get("points", [])}
    axes = {axis: extrapolate([(getattr(testbed.SPECS[n], value[axis]), beta[n])
                               for n in names if n in beta], SEED_MODEL_AXES[axis])
            for axis, names in testbed.LADDER_AXES.items()}
    axes["position"] = extrapolate([((p["lo"] + p["hi"]) / 2, p["beta_abs"]) for p in positions],
                                   SEED_MODEL_AXES["position"])
    return axes


def _drivers(plan: ReproductionPlan, a16: dict, sc: dict, out: Path, progress: bool
             ) -> dict[str, Any]:
    temps = {AuditSettings.temperature: a16["metrics"][mn.BETA_ABS_MEAN]}
    for t in DRIVER_TEMPERATURES:
        a = _audit(plan, "bf16", out / "audits" / f"bf16-T{t:g}", progress, temperature=t)
        temps[t] = a["metrics"][mn.BETA_ABS_MEAN]
    _audit(plan, "bf16", out / "audits" / "bf16-long", progress, tokens=plan.long_tokens)
    positions = beta_by_position(out / "audits" / "bf16-long" / "tokens.parquet",
                                 [b for b in POSITION_BINS if b <= plan.long_tokens])
    return {"axes": beta_drivers(sc, positions), "positions": positions,
            "temperatures": {f"{t:g}": v for t, v in sorted(temps.items())}}


def _token_clip(objective: str, eps: float) -> dict[str, float]:
    """The scaled ε for an objective that clips tokens; the others keep their own clip (GSPO's
    sequence range is already of the order of a sequence's mean β) or have none."""
    return {"eps_low": eps, "eps_high": eps} if OBJECTIVES[objective].clip == "token" else {}


def _earlier_timing(out: Path) -> dict[str, float]:
    """Each stage's time as earlier invocations into `out` measured it."""
    found: dict[str, float] = {}
    for name in ("claims.json", "timing.json"):
        if (out / name).is_file():
            d = read_json(out / name, "earlier reproduction")
            found.update(d.get("timing", {}) if name == "claims.json" else d)
    return found


class _Stages:
    """Times each stage of a reproduction. A stage an earlier, interrupted or shorter,
    invocation finished is reused in seconds: its own time is the one to report. Each stage's
    time is written as soon as it ends."""

    def __init__(self, out: Path, progress: bool):
        self.out, self.progress = out, progress
        self.done, self.timing = _earlier_timing(out), {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.timing[name] = max(time.perf_counter() - t0, self.done.get(name, 0.0))
        (self.out / "timing.json").write_text(json.dumps(self.timing, indent=1))
        if self.progress:
            print(f"[reproduce] {name}: {self.timing[name] / 60:.1f} min", flush=True)


def _arith(plan: ReproductionPlan, out: Path, workers: int, progress: bool, stage: _Stages,
           calibration: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], float | None]:
    """The arith sweeps at arith's own calibrated ε: the recipes, their long horizon, the other
    objectives, the asynchronous regime, LoRA. Returns the sweeps' summaries by name ("arith",
    "scored", "long", "algos" by objective, "async", "lora"; absent where the plan skips one)
    and ε."""
    sw: dict[str, Any] = {}
    if not plan.arith_steps:
        return sw, None
    with stage("arith calibration"):
        aa = _audit(plan, "bf16", out / "audits" / "bf16-arith", progress,
                    model=plan.arith_model, task="arith")
        eps, ok = calibrated_eps(aa)
        calibration["arith"] = {"eps": eps, "calibrated": ok,
                                "audit": f"audits/bf16-arith ({plan.arith_model})"}
    clip = {"steps": plan.arith_steps, "eps_low": eps, "eps_high": eps}
    with stage("arith sweep"):
        sw["arith"] = _sweep(plan, out / "sweeps" / "arith", plan.arith_recipes, plan.arith_seeds,
                             "arith", plan.arith_model, clip, workers, progress, scaled_clip(eps))
    if plan.scored_seeds:
        with stage("arith scored-shadow sweep"):
            sw["scored"] = _sweep(plan, out / "sweeps" / "arith-scored", ["bf16-shadow"],
                                  plan.scored_seeds, "arith", plan.arith_model,
                                  {**clip, "shadow_kernels": "scored"}, workers, progress)
    horizon = [r for r in HORIZON_RECIPES if r in plan.arith_recipes]
    if plan.horizon_steps > plan.arith_steps and horizon:
        with stage("arith long horizon"):
            sw["long"] = _sweep(plan, out / "sweeps" / "arith-long", horizon, plan.arith_seeds,
                                "arith", plan.arith_model, {**clip, "steps": plan.horizon_steps},
                                workers, progress, continue_from=out / "sweeps" / "arith")
    sw["algos"] = {}
    for obj in plan.algorithms:
        with stage(f"arith {obj} sweep"):
            sw["algos"][obj] = _sweep(plan, out / "sweeps" / f"arith-{obj}", ALGORITHM_RECIPES,
                                      plan.algorithm_seeds, "arith", plan.arith_model,
                                      {"steps": plan.arith_steps, "objective": obj,
                                       **_token_clip(obj, eps)}, workers, progress)
    if plan.async_seeds:
        with stage("arith async sweep"):
            sw["async"] = _sweep(plan, out / "sweeps" / "arith-async", plan.async_recipes,
                                 plan.async_seeds, "arith", plan.arith_model, {**clip, **ASYNC},
                                 workers, progress)
    if plan.lora_seeds:
        with stage("arith LoRA sweep"):
            sw["lora"] = _sweep(plan, out / "sweeps" / "arith-lora", LORA_RECIPES,
                                plan.lora_seeds, "arith", plan.arith_model, {**clip, **LORA},
                                workers, progress)
    return sw, eps


def _moe(plan: ReproductionPlan, out: Path, workers: int, progress: bool, stage: _Stages
         ) -> tuple[dict | None, dict | None] | None:
    """Claim 12's runs: the mixture of experts trained one step with a bf16 engine, without and
    with routing replay, on one seed; each run's step 1 (None where it failed)."""
    if not plan.moe_model:
        return None
    prompts, samples, tokens = plan.moe_completions
    firsts = []
    with stage("mixture of experts"):
        for name, replay in (("moe", False), ("moe-replay", True)):
            sw = _sweep(plan, out / "sweeps" / name, ["bf16-engine"], [0], "neg-length",
                        plan.moe_model, {"steps": 1, "prompts_per_step": prompts,
                                         "samples_per_prompt": samples,
                                         "max_new_tokens": tokens, "routing_replay": replay},
                        workers, progress)
            run = next(iter(sw["runs"].values()))
            metrics = Path(run["path"]) / "metrics.jsonl"
            firsts.append(load_metrics(metrics)[0] if run.get("ok") and metrics.is_file()
                          else None)
    return firsts[0], firsts[1]


def reproduce(plan: ReproductionPlan, out: Path, workers: int = 0, progress: bool = True
              ) -> dict[str, Any]:
    t_start = time.perf_counter()
    for sub in (out, out / "audits", out / "scale", out / "sweeps"):  # every stage's, at once
        ensure_writable(sub, "reproduce --out")
    out.mkdir(parents=True, exist_ok=True)
    stage = _Stages(out, progress)
    with stage("audits"):
        a16 = _audit(plan, "bf16", out / "audits" / "bf16-vs-fp32", progress)
        f16 = _audit(plan, "fp16", out / "audits" / "fp16-vs-fp32", progress)
    sc: dict[str, Any] = {}
    if plan.scale_models:
        with stage("scale"):
            sc = _scale(plan, out / "scale", progress, {plan.audit_model: a16})  # not twice

    # The scaled experiment: each sweep at the ε where its own model's bf16 engine phantom-clips
    # the seeds' 18% of tokens, at the start of training on its own task.
    eps_run, ok = calibrated_eps(a16)
    calibration: dict[str, dict[str, Any]] = {}
    main = None
    if plan.steps:
        with stage("neg-length calibration"):
            where = f"audits/bf16-vs-fp32 ({plan.audit_model})"
            if plan.sweep_model != plan.audit_model:   # its own model, not the audits' larger one
                where = f"audits/bf16-neg-length ({plan.sweep_model})"
                eps_run, ok = calibrated_eps(_audit(plan, "bf16",
                                                    out / "audits" / "bf16-neg-length",
                                                    progress, model=plan.sweep_model))
            calibration["neg-length"] = {"eps": eps_run, "calibrated": ok, "audit": where}
        with stage("neg-length sweep"):
            main = _sweep(plan, out / "sweeps" / "neg-length", MAIN_RECIPES, plan.seeds,
                          "neg-length", plan.sweep_model,
                          {"steps": plan.steps, "eps_low": eps_run, "eps_high": eps_run},
                          workers, progress, scaled_clip(eps_run))
    sw, eps_arith = _arith(plan, out, workers, progress, stage, calibration)
    with stage("small-lr runs"):
        lr = _sweep(plan, out / "sweeps" / "small-lr", ["bf16-engine", "fp16", "fp32"], [0],
                    "neg-length", plan.sweep_model,
                    {"steps": plan.small_lr_steps, "lr": plan.small_lr}, workers, progress)
    moe = _moe(plan, out, workers, progress, stage)
    drivers = None
    if plan.drivers:
        with stage("what makes β large"):
            drivers = _drivers(plan, a16, sc, out, progress)
            (out / "drivers.json").write_text(json.dumps(drivers, indent=1))

    claims = judge(a16, f16, sc, main, sw.get("arith"), lr, eps_run, plan, eps_arith,
                   sw.get("algos"), drivers, sw.get("async"), sw.get("lora"), sw.get("long"),
                   sw.get("scored"), moe)
    seconds = max(time.perf_counter() - t_start, sum(stage.timing.values()))
    result = {"plan": plan.name, "seconds": seconds, "timing": stage.timing, "eps_run": eps_run,
              "calibration": calibration, "claims": [c.to_dict() for c in claims]}
    (out / "claims.json").write_text(json.dumps(result, indent=1))
    (out / "claims.md").write_text(claims_markdown(claims, plan, seconds, calibration, out))
    return result


def _renamed(c: C.Claim, new_id: str) -> C.Claim:
    c.id = new_id
    return c


def _kl(m: dict[str, float]) -> float:
    """The exact KL where the audit sampled (μ known in full), else the k3 estimate."""
    return m[mn.KL_EXACT] if mn.KL_EXACT in m else m[mn.KL_K3]


def _groups(summary: dict[str, Any]) -> dict[str, dict]:
    """A sweep's groups, each with its seeds' steps to the threshold and final rewards (taken
    from its runs where a summary written before the groups kept them does not have them)."""
    runs = summary.get("runs", {}).values()
    out = {}
    for name, g in summary["groups"].items():
        mine = [r for r in runs if r.get("group") == name and "steps" in r]
        per_seed = {"steps_to_threshold_runs": [
            r["steps_to_threshold"] if r.get("steps_to_threshold") is not None
            else r["steps"] + 1 for r in mine],
            "final_reward_runs": [r["final_reward"] for r in mine],
            "reward_drop_runs": [r["peak_reward"] - r["final_reward"] for r in mine
                                 if r.get("peak_reward") is not None]}
        out[name] = {**per_seed, **g}
    return out


def judge(a16: dict, f16: dict, sc: dict, main: dict | None, arith: dict | None, lr: dict,
          eps_run: float, plan: ReproductionPlan, eps_arith: float | None = None,
          algos: dict[str, dict] | None = None, drivers: dict | None = None,
          asy: dict | None = None, lora_sweep: dict | None = None,
          long_sweep: dict | None = None, scored: dict | None = None,
          moe: tuple[dict | None, dict | None] | None = None) -> list[C.Claim]:
    """Measured numbers → claims. Pure apart from reading the dictionaries it is given. A sweep
    the plan did not run (`None`), or a recipe it left out, judges none of its claims. 5b-arith
    is judged over the long horizon where the plan ran one, else over the sweep's steps."""
    m16, mf16 = a16["metrics"], f16["metrics"]
    eps_arith = eps_run if eps_arith is None else eps_arith
    ran = set(plan.arith_recipes) if arith is not None else set()
    out = _audit_claims(a16, sc)
    if main is not None:
        out.append(C.stall_and_fixes("neg-length", _groups(main), eps_run))
    if arith is not None:
        out.append(_renamed(C.stall_and_fixes("arith", _groups(arith), eps_arith), "3-arith"))
    if arith is not None and scored is not None:
        both = {**_groups(arith), **{f"{k} (scored)": {**g, "recipe": "bf16-shadow-scored"}
                                     for k, g in _groups(scored).items()}}
        out.append(C.scored_shadow_restores(both, eps_arith))
    if asy is not None:
        out.append(C.async_stall_and_fixes(_groups(asy), eps_arith, ASYNC_SETTING))
    out.append(C.fp16_shrinks_gap(_kl(m16), _kl(mf16), m16[mn.BETA_ABS_MEAN],
                                  mf16[mn.BETA_ABS_MEAN]))
    out += _fix_claims(main, arith, long_sweep, ran, eps_run, eps_arith, plan)
    out += _fp16_claims(arith, algos, ran, m16, mf16)
    if drivers is not None:
        out.append(C.what_makes_beta_large(drivers["axes"], drivers["temperatures"]))
    if lora_sweep is not None:
        out.append(C.fp16_helps_with_lora(_groups(lora_sweep), eps_arith, LORA_SETTING))
    # A failed run, or one that reported no figure, is missing here, never a 0.
    changed = {g["recipe"]: g.get("changed_frac") for g in _groups(lr).values()}
    out.append(C.bf16_weights_freeze(changed.get("bf16-engine"), changed.get("fp16"),
                                     changed.get("fp32"), plan.small_lr))
    if moe is not None:
        out.append(replay_closes_the_routing_gap(
            *moe, plan.moe_model, plan.moe_completions[0] * plan.moe_completions[1]))
    return out


def _audit_claims(a16: dict, sc: dict) -> list[C.Claim]:
    """Claims 1a–2b: the bf16 audit's β and phantom clipping, and β against size."""
    m16 = a16["metrics"]
    fit = sc.get("fits", {}).get("beta_abs_mean")
    beta_abs = m16[mn.BETA_ABS_MEAN]
    eps_m = C.matched_eps(beta_abs)
    return [
        C.beta_is_minus_kl(m16[mn.BETA_MEAN], m16.get(mn.BETA_MEAN_SE),
                           a16["completions"], _kl(m16)),
        C.beta_correlates_with_advantage(m16.get(mn.BETA_ADV_CORR),
                                         m16.get(mn.BETA_ADV_CORR_SE)),
        C.beta_grows_with_size(fit["slope"] if fit else None,
                               fit.get("slope_se") if fit else None,
                               len(sc.get("points", [])), fit["at"]["6e+08"] if fit else None),
        C.phantom_at_seed_eps(phantom_at(a16["phantom_vs_eps"], C.SEED_EPS), beta_abs),
        C.phantom_at_matched_eps(eps_m, phantom_at(a16["phantom_vs_eps"], eps_m),
                                 eps_at_share(a16["phantom_vs_eps"], C.SEED_PHANTOM)),
    ]


def _fix_claims(main: dict | None, arith: dict | None, long_sweep: dict | None, ran: set[str],
                eps_run: float, eps_arith: float, plan: ReproductionPlan) -> list[C.Claim]:
    """Claims 5a and 5b: a wider clip range, and the recompute family, on each task."""
    out = []
    if main is not None:
        out.append(C.wide_eps_helps(_groups(main), eps_run, round(1.4 * eps_run, 6),
                                    "neg-length"))
    if "wide-eps" in ran:
        out.append(_renamed(C.wide_eps_helps(_groups(arith), eps_arith, round(1.4 * eps_arith, 6),
                                             "arith"), "5a-arith"))
    if main is not None:
        out.append(C.recompute_family(_groups(main), "neg-length"))
    if long_sweep is not None:
        out.append(_renamed(C.recompute_family(_groups(long_sweep), "arith", plan.horizon_steps),
                            "5b-arith"))
    elif {"recompute", "tis", "seq-mis"} <= ran:
        out.append(_renamed(C.recompute_family(_groups(arith), "arith", plan.arith_steps),
                            "5b-arith"))
    return out


def _fp16_claims(arith: dict | None, algos: dict[str, dict] | None, ran: set[str],
                 m16: dict[str, float], mf16: dict[str, float]) -> list[C.Claim]:
    """Claims 7–9 on arith: fp16 restores training, the mismatch over training, and fp16
    across the other algorithms."""
    out = []
    if {"bf16-engine", "fp16"} <= ran:
        out.append(_renamed(C.fp16_restores(_groups(arith), "arith"), "7-arith"))
        slopes = {"bf16": m16.get(mn.SEQ_LOG_RATIO_SLOPE),
                  "fp16": mf16.get(mn.SEQ_LOG_RATIO_SLOPE)}
        out.append(_renamed(C.mismatch_over_training(arith.get("runs", {}), "arith", slopes),
                            "8-arith"))
    if algos and set(ALGORITHM_RECIPES) <= ran:
        by = {"ppo-clip (GRPO)": _groups(arith), **{o: _groups(a) for o, a in algos.items()}}
        out.append(_renamed(C.fp16_across_algorithms(by, "arith"), "9-arith"))
    return out


def _sweeps_said(plan: ReproductionPlan) -> list[str]:
    """What each sweep the plan runs trains, in words."""
    sweeps = []
    if plan.steps:
        sweeps.append(f"neg-length on `{plan.sweep_model}`, {plan.steps} steps, seeds "
                      f"{plan.seeds}")
    if plan.arith_steps:
        sweeps.append(f"arith on `{plan.arith_model}`, {plan.arith_steps} steps, seeds "
                      f"{plan.arith_seeds}, recipes {', '.join(plan.arith_recipes)}")
    if plan.arith_steps and plan.horizon_steps > plan.arith_steps:
        sweeps.append(f"arith {', '.join(HORIZON_RECIPES)} trained on to {plan.horizon_steps} "
                      f"steps (claim 5b-arith)")
    if plan.arith_steps and plan.async_seeds:
        sweeps.append(f"arith asynchronous ({ASYNC_SETTING}; {', '.join(plan.async_recipes)}; "
                      f"seeds {plan.async_seeds})")
    if plan.arith_steps and plan.scored_seeds:
        sweeps.append(f"arith bf16-shadow with the shadow the engine scores itself "
                      f"(`--shadow-kernels scored`; seeds {plan.scored_seeds})")
    if plan.arith_steps and plan.lora_seeds:
        sweeps.append(f"arith with {LORA_SETTING} ({', '.join(LORA_RECIPES)}; seeds "
                      f"{plan.lora_seeds})")
    if plan.arith_steps and plan.algorithms:
        recipes = ", ".join(ALGORITHM_RECIPES)
        sweeps.append(f"arith with objectives {', '.join(plan.algorithms)} ({recipes}; seeds "
                      f"{plan.algorithm_seeds}; the scaled ε where the objective clips tokens, "
                      f"its own clip otherwise)")
    return sweeps


def claims_markdown(claims: list[C.Claim], plan: ReproductionPlan, seconds: float,
                    calibration: dict[str, dict[str, Any]], out: Path) -> str:
    sweeps = _sweeps_said(plan)
    eps = []
    for task, c in calibration.items():
        eps.append(f"{task} ε = {c['eps']:g} " + (
            f"(where {c['audit']}'s bf16 engine clips the seeds' 18% of tokens at sync, "
            "every one of them numerically)"
            if c["calibrated"] else
            f"(NOT calibrated: {c['audit']}'s bf16 engine never clips 18% of tokens at sync "
            f"at any ε audited; a fixed fallback)"))
    command = {"quick": "parity reproduce --quick",
               "vllm": "parity reproduce --engine vllm"}.get(plan.name, "parity reproduce")
    engine = (" Every audit and run samples with vLLM's engine (`--engine vllm`); the trainer, "
              "its shadow forward and its recomputed log-probs are parity's own."
              if plan.engine == "vllm" else "")
    pre = (f"`{command}`: {seconds / 60:.1f} min on this machine.{engine} Audits on "
           f"`{plan.audit_model}` ({plan.samples} completions each); sweeps: "
           f"{'; '.join(sweeps)}. Clip ranges: {'; '.join(eps)}. The small-lr runs use "
           f"ε = {Config.eps_low:g}. `claims.json` has every measured number.")
    title = "Claims of the seeds, measured on the CPU testbed" + (
        " with vLLM as the engine" if plan.engine == "vllm" else "")
    md = C.to_markdown(claims, title, pre)
    figs = [("sweeps/neg-length/sweep.png", "neg-length: recipes at the scaled ε"),
            ("sweeps/arith/sweep.png", "arith: recipes at the scaled ε"),
            ("sweeps/arith-long/sweep.png", f"arith: {', '.join(HORIZON_RECIPES)} to "
                                            f"{plan.horizon_steps} steps"),
            *((f"sweeps/arith-{o}/sweep.png", f"arith, objective {o}: fp32, bf16-engine, fp16")
              for o in plan.algorithms),
            ("sweeps/arith-async/sweep.png", f"arith, {ASYNC_SETTING}"),
            ("sweeps/arith-lora/sweep.png", f"arith, {LORA_SETTING}"),
            ("scale/scale.png", "mismatch against model size"),
            ("audits/bf16-vs-fp32/phantom_vs_eps.png", "bf16 engine: clip fractions against ε"),
            ("audits/bf16-arith/phantom_vs_eps.png",
             "bf16 engine on arith: clip fractions against ε (its sweep's calibration)")]
    md += _sweep_tables(out)
    for path, caption in figs:
        if (out / path).is_file():
            md += f"\n### {caption}\n\n![{caption}]({path})\n"
    return md


def _sweep_tables(out: Path) -> str:
    md = ""
    for name, caption in (("arith", "arith: each recipe's seeds"),
                          ("arith-scored", "arith: bf16-shadow with the engine-scored shadow")):
        if (out / "sweeps" / name / "summary.json").is_file():
            summary = read_json(out / "sweeps" / name / "summary.json", "sweep summary")
            md += f"\n### {caption}\n\n" + sweep_table(summary) + "\n"
    return md


def sweep_table(summary: dict[str, Any]) -> str:
    """One row per recipe of a sweep: seeds reaching the task's threshold, their steps to it
    ("never": not within the run), the final reward and the share clipped (of which phantom)
    over the first steps."""
    lines = ["| recipe | seeds reaching it | steps to it (median; per seed) | final reward | "
             "clipped, first steps | of which phantom |", "|---|---:|---|---:|---:|---:|"]
    runs = list(summary["runs"].values())
    for name, g in summary["groups"].items():
        mine = sorted((r for r in runs if r.get("group") == name and r.get("ok")),
                      key=lambda r: r["seed"])
        per_seed = ", ".join("never" if r.get("steps_to_threshold") is None
                             else str(r["steps_to_threshold"]) for r in mine)
        med = g.get("steps_to_threshold_median")
        pct = ("missing" if g.get(k) is None else f"{100 * g[k]:.1f}%"
               for k in ("early_clip_frac", "early_phantom_frac"))
        lines.append(f"| `{g['recipe']}` | {g.get('reached', 0)}/{len(mine)} | "
                     f"{'never' if med is None or not g.get('reached') else f'{med:g}'} "
                     f"({per_seed}) | "
                     f"{g['final_reward']:.3f} | " + " | ".join(pct) + " |")
    return "\n".join(lines)


def print_claims(result: dict[str, Any]) -> None:
    cal = result.get("calibration") or {}
    eps = "".join(f", {task} ε = {c['eps']:g}" + ("" if c["calibrated"] else " (not calibrated)")
                  for task, c in cal.items())
    t = Table(title=f"parity reproduce ({result['plan']}): {result['seconds'] / 60:.1f} min{eps}")
    for col in ("claim", "statement", "seeds", "measured", "verdict"):
        t.add_column(col, overflow="fold")
    for c in result["claims"]:
        color = {"holds": "green", C.NOT_AT_SCALE: "yellow"}.get(c["verdict"], "dim")
        t.add_row(c["id"], c["statement"], c["seeds"], c["reason"],
                  f"[{color}]{c['verdict']}[/]")
    ui.console(160).print(t)
