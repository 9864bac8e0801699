"""parity inside verl: every step's mismatch figures and clip attribution, from verl's own batch.

    pip install 'parity[verl]'

puts `parity.integrations.verl_plugin` in the entry-point group `verl.plugins`, which `import
verl` loads in every process. A verl run then logs, on its driver, parity's figures under
`parity/` beside verl's own metrics, and under verl's own names (`rollout_corr/kl`, `k3_kl`)
where verl's rollout correction, which logs them, is off; nothing else changes (docs/verl.md).

Decoupled mode (verl's default: the actor recomputes ℓ_old at θ_old before it updates): after
`compute_advantage` the batch holds ℓ_old (`old_log_probs`), the engine's ℓ_μ
(`rollout_log_probs`, with `actor_rollout_ref.rollout.calculate_log_probs=True`), the advantages
and the response mask. At θ_old the engine's ℓ_μ is what parity's engine-scored shadow would give
(the engine scoring the trainer's weights in its own precision), so α = 0 and β = ℓ_old − ℓ_μ:
the whole trainer-engine gap, and a token whose clip fires on β alone, at the run's clip range
and its advantage's sign, is clipped by numerics (clip/phantom_frac). Those are the tokens a
ratio with the engine's log-probs in it (verl's bypass mode, an AsyncGRPO-style ratio) would
zero at the step's first update. The α figures and the kernel gap are 0 by construction here and
are not logged.

Bypass mode (old_log_probs := rollout_log_probs): ℓ_old is never computed, so nothing can be
attributed; the plugin says so once and logs no figure. Computing ℓ_old costs the actor one
forward over the batch, which is what decoupled mode does.

verl has no hook for metrics on the driver, so the plugin wraps two names of
`verl.trainer.ppo.ray_trainer` when that module loads: `RayPPOTrainer.fit`, to read the run's
clip range and mode from its config, and `compute_data_metrics`, to add the figures to what it
returns. Both call verl's own code unchanged: the loss, the batch and verl's own metrics are
what they would be without the plugin. On a verl version it was not written for
(VERL_VERSIONS), it says so in one line and installs nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from parity import metric_names as mn
from parity.config import FIELDS
from parity.diagnostics import StepDiagnostics, measure
from parity.models.precision import torch_dtype
from parity.runs.finite import LeftOutTally, usable_tokens

VERL_VERSIONS = ("0.9.1",)
TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
PREFIX = "parity/"
# 0 by construction with ℓ_s = ℓ_μ: no shadow of parity's own runs inside verl.
NOT_MEASURED = (mn.ALPHA_MEAN, mn.ALPHA_ABS_MEAN, mn.ALPHA_CLIP_FRAC, mn.HIDDEN_FRAC,
                mn.KERNEL_GAP_ABS_MEAN)
CLIP_FRACTIONS = (mn.CLIP_FRAC, mn.PHANTOM_FRAC, mn.HIDDEN_FRAC, mn.ALPHA_CLIP_FRAC)
# How each verl policy loss clips: per token, per sequence (GSPO), or not at all.
CLIP_OF_LOSS = {"vanilla": "token", "gspo": "sequence"}

logger = logging.getLogger(__name__)


# parity's figures verl itself logs under its own names when its rollout correction runs
# (metric_names.ELSEWHERE): without one configured, the plugin logs them under verl's names too.
VERL_NAMES = {e.name: e.verl for e in mn.ELSEWHERE if e.verl.startswith("rollout_corr/")
              and e.name in (mn.KL_K1, mn.KL_K3)}


@dataclass
class RunSettings:
    """What the figures need of the run's config, read when its trainer starts."""
    eps_low: float | None = 0.2
    eps_high: float | None = 0.2
    clip: str | None = "token"       # CLIP_OF_LOSS's value; None: the loss does not clip
    bypass: bool = False
    verl_corrects: bool = False      # verl's rollout correction runs, logging rollout_corr/*
    said: set[str] = field(default_factory=set)   # the once-a-run lines already said
    left_out: LeftOutTally = field(default_factory=lambda: LeftOutTally("verl's batch"))


RUN = RunSettings()
NO_MU = ("parity: verl's batch has no rollout_log_probs, the engine's log-probs every figure "
         "is measured against, so parity logs none: set actor_rollout_ref.rollout."
         "calculate_log_probs=True (docs/verl.md)")

# verl refuses router_replay R2 together with the rollout's routing (ray_trainer.py), so its
# batch holds one side's experts, and the routing gap needs both (docs/moe.md).
ONE_SIDES_ROUTING = ("parity: verl's batch carries routed_experts, one side's routing (the "
                     "rollout's under router_replay R3, the actor's under R2) and never both, so "
                     "parity logs the dense figures and no routing/ figures; under R3 the "
                     "actor's old_log_probs already route as the rollout did (docs/moe.md)")


def _warn(message: str) -> None:
    logger.warning("parity: %s", message)


def _say_once(run: RunSettings, line: str) -> None:
    if line not in run.said:
        run.said.add(line)
        logger.warning(line)


def step_figures(batch: Any, run: RunSettings) -> dict[str, float]:
    """parity's figures of one verl batch (a DataProto after `compute_advantage`), under
    parity's metric names with PREFIX; empty where the batch cannot give them. A log-prob
    that is NaN or inf, or positive (logits in `rollout_log_probs`, say), is left out of every
    figure and counted (parity/runs/finite.py)."""
    b = batch.batch
    if run.bypass or "old_log_probs" not in b.keys():
        return {}
    if "rollout_log_probs" not in b.keys():
        _say_once(run, NO_MU)
        return {}
    if "routed_experts" in b.keys():
        _say_once(run, ONE_SIDES_ROUTING)
    mask = b["response_mask"].double()
    mask, (old, mu), left_out = usable_tokens(mask, b["old_log_probs"].double(),
                                              b["rollout_log_probs"].double())
    run.left_out.add(left_out, _warn)
    adv = b["advantages"].double()
    eps = (run.eps_low, run.eps_high) if run.clip else (None, None)
    diag = StepDiagnostics()
    measure(diag, old, mu, mu, adv, mask, *eps, sequence=run.clip == "sequence")
    figures = diag.metrics()
    figures.update({k: float(n) for k, n in left_out.counts().items() if n})
    for name in NOT_MEASURED if run.clip else NOT_MEASURED + CLIP_FRACTIONS:
        figures.pop(name, None)
    beside = {} if run.verl_corrects else {verl: figures[ours] for ours, verl in
                                           VERL_NAMES.items() if ours in figures}
    return {**{PREFIX + k: v for k, v in figures.items()}, **beside}


def _setting(config: Any, path: str, default: Any) -> Any:
    """`config.a.b.c` of an OmegaConf config or a mapping, or `default` where a key is absent."""
    node = config
    for key in path.split("."):
        node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        if node is None:
            return default
    return node


def settings_of(config: Any) -> RunSettings:
    """The figures' settings from a verl trainer config (ppo_trainer.yaml's keys)."""
    actor = _setting(config, "actor_rollout_ref.actor", {})
    loss_mode = _setting(actor, "policy_loss.loss_mode", "vanilla")
    return RunSettings(
        eps_low=_setting(actor, "clip_ratio_low", _setting(actor, "clip_ratio", 0.2)),
        eps_high=_setting(actor, "clip_ratio_high", _setting(actor, "clip_ratio", 0.2)),
        clip=CLIP_OF_LOSS.get(loss_mode),
        bypass=bool(_setting(config, "algorithm.rollout_correction.bypass_mode", False)),
        verl_corrects=any(_setting(config, f"algorithm.rollout_correction.{k}", None)
                          is not None for k in ("rollout_is", "rollout_rs")))


def _fit_reading_settings(fit: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fit)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        global RUN
        RUN = settings_of(self.config)
        if RUN.bypass:
            logger.warning("parity: verl's bypass mode never computes l_old, so no clip can be "
                           "attributed to numerics; parity logs no figure (docs/verl.md)")
        return fit(self, *args, **kwargs)
    return wrapped


def _metrics_with_figures(compute: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(compute)
    def wrapped(batch: Any, *args: Any, **kwargs: Any) -> dict:
        out = compute(batch, *args, **kwargs)
        try:
            figures = step_figures(batch, RUN)
        except Exception as e:  # a figure parity cannot compute must not stop the user's run
            logger.warning("parity: no figures this step: %s", e)
            figures = {}
        return {**out, **figures}
    return wrapped


def patch_trainer(module: Any) -> None:
    """verl's ray_trainer with the figures added (see the module's docstring)."""
    if getattr(module, "_parity_patched", False):
        return
    module.RayPPOTrainer.fit = _fit_reading_settings(module.RayPPOTrainer.fit)
    module.compute_data_metrics = _metrics_with_figures(module.compute_data_metrics)
    module._parity_patched = True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` has been imported, before anyone uses it."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            execute(module)
            then(module)
        spec.loader.exec_module = exec_module
        return spec


def install(version: str) -> bool:
    """The wrappers, on a verl version they were written for; False (and one line) otherwise."""
    if version not in VERL_VERSIONS:
        print(f"parity: verl {version} is not a version parity's plugin was written for "
              f"({', '.join(VERL_VERSIONS)}); it adds no figures (docs/verl.md)", file=sys.stderr)
        return False
    if TRAINER_MODULE in sys.modules:
        patch_trainer(sys.modules[TRAINER_MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport(TRAINER_MODULE, patch_trainer))
    return True


# ---- the recipes as verl settings (`parity recipes --for verl NAME`) ---------------------------

# Past any ratio a run reaches: verl has no switch that turns clipping off.
NO_CLIP = 1e9
# A lower bound below every weight: verl's masks take [lower, upper] with lower > 0, and its
# weights are exp(Δ) with Δ clamped to ±20, so never below 2e-9.
NO_LOWER = 1e-30


def recipe_overrides(st: dict[str, Any]) -> tuple[list[str], list[str]]:
    """verl 0.9.1 config overrides (Hydra syntax, ppo_trainer.yaml's keys) that implement a
    recipe's settings `st`, and what verl has no equivalent of, one line each. Read from verl's
    source (docs/verl.md says which file holds each key)."""
    rollout_dtype = str(torch_dtype(st["engine_dtype"])).removeprefix("torch.")
    out = [f"actor_rollout_ref.rollout.dtype={rollout_dtype}",
           # verl's FSDP engine autocasts in param_dtype and adds ShardedGradScaler for fp16
           f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="
           f"{st['trainer_dtype']}",
           # the engine's log-probs: verl's rollout_corr and parity's figures read them
           "actor_rollout_ref.rollout.calculate_log_probs=true"]
    missing: list[str] = []
    source = st["ratio_source"]
    if source == "shadow":
        missing.append("ratio_source=shadow: a shadow forward (the trainer's weights in engine "
                       "precision); the nearest is decoupled mode, as set here (recipe recompute)")
    out.append("algorithm.rollout_correction.bypass_mode="
               + ("true" if source == "engine" else "false"))
    low, high = st["eps_low"], st["eps_high"]
    out += [f"actor_rollout_ref.actor.clip_ratio_low={1.0 if low is None else low}",
            f"actor_rollout_ref.actor.clip_ratio_high={NO_CLIP if high is None else high}"]
    if low is None and high is None:
        out.append(f"actor_rollout_ref.actor.clip_ratio_c={NO_CLIP}")  # and no dual clip
    out += _correction(st, missing)
    if _value(st, "kernels") != FIELDS["kernels"].default:
        missing.append(f"kernels={st['kernels']}: parity's batch-invariant kernels on both sides "
                       f"and the trainer's forward in the engine's dtype (docs/zero-mismatch.md); "
                       f"verl's rollout and actor run their own")
    return out, missing


def _value(st: dict[str, Any], name: str) -> Any:
    """A recipe's setting, or Config's default where the recipe leaves it."""
    return st.get(name, FIELDS[name].default)


def _correction(st: dict[str, Any], missing: list[str]) -> list[str]:
    """verl's rollout_correction for parity's `correction` (objectives/losses.py's weights)."""
    kind, cap = st["correction"], _value(st, "is_cap")
    key = "algorithm.rollout_correction."
    if kind == "none":
        return [f"{key}rollout_is=null", f"{key}rollout_rs=null"]
    if kind == "geo-rs":
        geo = _value(st, "geo_cap")
        return [f"{key}rollout_is=null", f"{key}rollout_rs=seq_mean_k1",
                f"{key}rollout_rs_threshold={1 / geo:.6g}_{geo}"]
    if kind in ("token-tis", "seq-tis"):
        level = "token" if kind == "token-tis" else "sequence"
        return [f"{key}rollout_is={level}", f"{key}rollout_is_threshold={cap}",
                f"{key}rollout_rs=null"]
    if kind in ("token-mis", "token-icepop"):
        low = _value(st, "is_cap_low") if kind == "token-icepop" else NO_LOWER
        return [f"{key}rollout_is=token", f"{key}rollout_is_threshold={low}_{cap}",
                f"{key}rollout_rs=null"]
    missing.append("correction=seq-mis exactly: verl rejects the sequences (rollout_rs) and "
                   "drops their tokens from the loss's normaliser, where parity weighs them 0")
    return [f"{key}rollout_is=sequence", f"{key}rollout_is_threshold={cap}",
            f"{key}rollout_rs=seq_sum_k1", f"{key}rollout_rs_threshold={NO_LOWER}_{cap}"]
