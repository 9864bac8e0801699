"""A GRPOConfig as ParityGRPOTrainer takes it: its sampling arguments checked, its defaults adapted.

- The sampling arguments are checked as transformers checks them before it samples
  (`SamplingArgs`), at construction: a bad value stops the run in one line naming the field
  rather than after the first step, when its NaN would already be in the weights.
- TRL's defaults that contradict a recipe are changed, not refused, with one line saying which
  and why: a stock GRPOConfig runs with any recipe `ParityOptions.from_recipe` accepts.
  `bf16=True` (TRL's default) becomes the recipe's trainer precision, `top_p` above 1 becomes 1
  (transformers applies no top-p cut there, so TRL's own trainer samples from the whole
  distribution, where parity's checks and vLLM refuse it), and with `use_vllm=True`
  TRL's importance correction (on by default) is turned off where the recipe's ratio already
  holds vLLM's log-probs, which it would weight by exp(ℓ_old − ℓ_μ) a second time.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from parity.config import SamplingArgs
from parity.integrations.trl_vllm import SAMPLING_KEYS

logger = logging.getLogger(__name__)

# GRPOConfig's precision flags for each trainer precision, and accelerate's name for it.
FLAGS = {"fp32": dict(bf16=False, fp16=False), "bf16": dict(bf16=True, fp16=False),
         "fp16": dict(bf16=False, fp16=True)}
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _top_p_as_run(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with a top_p above 1 as 1: transformers adds its top-p warper only below 1, so
    TRL's own trainer samples a top_p of 1.5 from the whole distribution, as top_p=1 does."""
    top_p = values.get("top_p")
    return {**values, "top_p": 1.0} if top_p is not None and top_p > 1 else values


def check_sampling(args: Any) -> None:
    """The config's sampling arguments and those its generation_kwargs override, as `adapted`
    leaves them."""
    name = type(args).__name__
    SamplingArgs.check(name, **_top_p_as_run({k: getattr(args, k) for k in SAMPLING_KEYS}))
    extra = {k: v for k, v in (getattr(args, "generation_kwargs", None) or {}).items()
             if k in SAMPLING_KEYS}
    SamplingArgs.check(f"{name}.generation_kwargs", **_top_p_as_run(extra))


def trainer_dtype(args: Any) -> str:
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def adapted(args: Any, p: Any) -> Any:
    """`args` (a GRPOConfig or an AsyncGRPOConfig) as the parity options `p` need it: a copy
    with what changed, each change in one line at start-up; `args` itself is left alone."""
    why = f"recipe {p.recipe}" if p.recipe else "these parity options"
    changes, out = [], copy.copy(args)
    want = p.trainer_dtype
    if want is not None and want != trainer_dtype(args):
        flip = {k: v for k, v in FLAGS[want].items() if getattr(args, k) != v}
        changes.append(" and ".join(f"{k}={getattr(args, k)} set to {v}" for k, v in flip.items())
                       + f": {why} trains in {want}")
        for k, v in flip.items():
            setattr(out, k, v)
        out.mixed_precision = MIXED_PRECISION[want]   # derived from the flags at construction
    whole = "transformers applies no top-p cut above 1, so TRL samples from the whole distribution"
    if args.top_p > 1:
        changes.append(f"top_p={args.top_p} set to 1.0: {whole}")
        out.top_p = 1.0
    kwargs = getattr(args, "generation_kwargs", None) or {}
    if _top_p_as_run(kwargs) is not kwargs:
        changes.append(f"generation_kwargs top_p={kwargs['top_p']} set to 1.0: {whole}")
        out.generation_kwargs = _top_p_as_run(kwargs)   # a new dict: the user's is left alone
    if getattr(args, "use_vllm", False) and args.vllm_importance_sampling_correction and \
            p.ratio_source != "recompute":
        changes.append(f"vllm_importance_sampling_correction=True set to False: {why} puts "
                       f"vLLM's log-probs in the ratio (ratio_source={p.ratio_source}), which "
                       f"TRL's correction would weight by exp(l_old - l_mu) again")
        out.vllm_importance_sampling_correction = False
    for line in changes:
        logger.warning("parity: %s %s", type(args).__name__, line)
    return out
