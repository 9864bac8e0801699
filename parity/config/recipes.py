"""Recipes: named presets of Config (docs/design.md's table), and how a run's config is made from
the defaults, a recipe, the built-in task's defaults, a YAML file and the flags.

Precedence, lowest first: field defaults, the recipe's preset, the built-in task's defaults, a
YAML file (`--config`), command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity.config.fields import coerce, quoted
from parity.config.run import FIELDS, TASK_DEFAULTS, Config
from parity.errors import ParityError
from parity.objectives import OBJECTIVES


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    settings: dict[str, Any]



# What every recipe sets.
RECIPE_FIELDS = ("engine_dtype", "trainer_dtype", "ratio_source", "eps_low", "eps_high",
                 "seq_eps_low", "seq_eps_high", "correction", "kernels")


def _mismatch(**kw: Any) -> dict[str, Any]:
    """bf16 engine against an fp32 trainer, as Config's defaults have it (bf16-engine is the
    default recipe), with the fix's own settings on top."""
    return {**{k: FIELDS[k].default for k in RECIPE_FIELDS}, **kw}


# docs/design.md's table: the mismatch, the fixes, and the references.
RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16-engine", "The mismatch: bf16 engine, fp32 trainer, engine log-probs in the ratio.",
           _mismatch()),
    Recipe("bf16-shadow", "Beta out of the ratio: its value comes from a bf16 shadow forward on "
           "the trainer's weights, its gradient from the fp32 forward.",
           _mismatch(ratio_source="shadow")),
    Recipe("wide-eps", "The mismatch with a wider clip range (DAPO's clip-higher 0.28; GSPO's "
           "doubled); set eps_high/eps_low to taste.",
           _mismatch(eps_high=0.28, seq_eps_high=2 * FIELDS["seq_eps_high"].default)),
    Recipe("no-clip", "The mismatch without clipping (token and sequence).",
           _mismatch(eps_low=None, eps_high=None, seq_eps_low=None, seq_eps_high=None)),
    Recipe("recompute", "Decoupled PPO: old log-probs recomputed by the fp32 trainer, beta "
           "leaves the ratio (and no behaviour weight).",
           _mismatch(ratio_source="recompute")),
    Recipe("tis", "recompute, times the token weight exp(l_old - l_mu) truncated at is_cap "
           "(truncated importance sampling).",
           _mismatch(ratio_source="recompute", correction="token-tis")),
    Recipe("icepop", "recompute, times the token weight exp(l_old - l_mu) where it lies in "
           "[is_cap_low, is_cap], 0 outside (IcePop, at verl's bounds 0.5 and 5).",
           _mismatch(ratio_source="recompute", correction="token-icepop", is_cap=5.0,
                     is_cap_low=0.5)),
    Recipe("seq-mis", "recompute, times the sequence weight, sequences beyond is_cap masked "
           "(masked importance sampling).",
           _mismatch(ratio_source="recompute", correction="seq-mis")),
    Recipe("fp16", "The FP16 paper: fp16 engine, fp16 autocast trainer over fp32 master weights "
           "with dynamic loss scaling.",
           _mismatch(engine_dtype="fp16", trainer_dtype="fp16")),
    Recipe("bf16", "bf16 on both sides: bf16 engine, bf16 autocast trainer.",
           _mismatch(trainer_dtype="bf16")),
    Recipe("fp32", "The reference: fp32 engine and fp32 trainer.",
           _mismatch(engine_dtype="fp32")),
    Recipe("bitwise", "Zero mismatch: bf16 on both sides with the same bits, invariant kernels "
           "and the trainer's forward the engine's over fp32 master weights (beta exactly 0).",
           _mismatch(trainer_dtype="bf16", kernels="invariant")),
]}

def recipe(name: str, where: str | None = None) -> Recipe:
    """The recipe `name`, refused in one line where there is none. `where`: an integration
    that runs each side's own kernels only, where a recipe that needs others is refused too."""
    if name not in RECIPES:
        raise ParityError(f"unknown recipe {quoted(name)}; known recipes: {', '.join(RECIPES)}")
    r = RECIPES[name]
    if where and r.settings["kernels"] != FIELDS["kernels"].default:
        raise ParityError(f"recipe {name!r} needs kernels={r.settings['kernels']}, which {where} "
                          f"do not run yet: train it with `parity train --recipe {name}` "
                          f"(docs/zero-mismatch.md)")
    return r


def make_config(explicit: dict[str, Any]) -> Config:
    """defaults < recipe < the built-in task's defaults < explicit values (YAML, then flags)."""
    explicit = {k: coerce(k, v, Config) for k, v in explicit.items()}
    recipe = explicit.get("recipe", Config.recipe)
    if recipe not in RECIPES:
        raise ParityError(f"unknown recipe {quoted(recipe)}; known recipes: "
                          f"{', '.join(RECIPES)}")
    values: dict[str, Any] = dict(RECIPES[recipe].settings)
    values.update(TASK_DEFAULTS.get(explicit.get("task", Config.task), {}))
    preset = dict(values)
    values.update(explicit)
    values["recipe"] = recipe

    def changed(k: str) -> bool:  # set by the user to something the recipe does not say
        return k in explicit and explicit[k] != preset.get(k, getattr(Config, k))
    _check_clip_ranges(values.get("objective", Config.objective),
                       [k for k in ("eps_low", "eps_high", "seq_eps_low", "seq_eps_high")
                        if changed(k)])
    return Config(**values).validate()


def _check_clip_ranges(objective: str, given: list[str]) -> None:
    """Refuse a clip range the objective does not use. Only ranges the user set count: every
    recipe sets both kinds."""
    if objective not in OBJECTIVES:
        return  # validate names the choices
    clip = OBJECTIVES[objective].clip
    for k in given:
        sequence = k.startswith("seq_")
        if clip is None:
            raise ParityError(f"objective={objective} has no clip; {k} does not apply")
        if clip == "sequence" and not sequence:
            raise ParityError(f"objective={objective} clips the sequence ratio with seq_eps_low/"
                              f"seq_eps_high; {k} (a token clip range) does not apply")
        if clip == "token" and sequence:
            raise ParityError(f"{k} is GSPO's sequence clip range; objective={objective} "
                              f"clips tokens with eps_low/eps_high")


