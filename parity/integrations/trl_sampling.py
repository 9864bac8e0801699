"""Sampling in ParityGRPOTrainer: what TRL's own sampling would do that parity's engine cannot,
and the trainer's log-probs under the distribution the engine samples from.

The engine samples without `model.generate`, so a patched `generate` and every logits processor
that transformers would build from the generation config are bypassed: they are named in one
warning at start-up (docs/trl.md, "Limits"), and what has no sampling distribution is refused.
TRL's fused head scores log_softmax(logits / T) alone; where the sampling distribution also
truncates (top-k, top-p, min-p) or penalises repetitions, `token_logps` scores under it."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import torch
from transformers import GenerationConfig, GenerationMixin

from parity.errors import ParityError
from parity.logprobs import Sampling, processed_logits, seen_before

logger = logging.getLogger(__name__)

# Generation settings that do not change the distribution a token is drawn from, or that parity
# sets itself from GRPOConfig (the length, the stop tokens).
NEUTRAL = frozenset({
    "max_new_tokens", "max_length", "do_sample", "use_cache", "cache_implementation",
    "cache_config", "pad_token_id", "bos_token_id", "eos_token_id", "disable_compile",
    "compile_config", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "num_return_sequences", "_from_model_config",
    "transformers_version"})


def effective_config(model: torch.nn.Module, trl_config: GenerationConfig) -> GenerationConfig:
    """The config transformers' generate would sample TRL's completions with: TRL's own, its
    unset fields filled from the model's generation config (as `generate` fills them)."""
    gc = copy.deepcopy(trl_config)
    gc.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    return gc


def check_sampling(gc: GenerationConfig) -> None:
    """Refuse what has no sampling distribution: the ratio's denominator ℓ_μ is the log-prob of
    the distribution each token was drawn from."""
    if (gc.num_beams or 1) > 1:
        raise ParityError(f"num_beams={gc.num_beams} in the generation config: beam search keeps "
                          f"the likeliest sequences instead of drawing tokens, so no sampling "
                          f"log-prob exists for the ratio; set num_beams=1")
    if gc.do_sample is False:
        raise ParityError("do_sample=False in generation_kwargs: greedy decoding draws nothing, "
                          "so no sampling log-prob exists for the ratio; leave do_sample to TRL")


def bypassed(model: torch.nn.Module, gc: GenerationConfig, s: Sampling, max_new_tokens: int
             ) -> list[str]:
    """What TRL's own trainer would sample with and parity's engine does not: a patched or
    overridden `generate`, and every setting of `gc` that changes the distribution beyond `s`."""
    out = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if any("generate" in vars(m) for m in (model, base)):
        out.append("a patched model.generate")
    elif getattr(type(base), "generate", None) not in (None, GenerationMixin.generate):
        out.append(f"{type(base).__name__}.generate")
    ours = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty}
    defaults = base.generation_config._get_default_generation_params()
    for key, value in sorted(gc.to_diff_dict().items()):
        if key in ours:
            # compared as a Sampling holds it (top_p=0 is the likeliest token alone)
            if value is not None and getattr(replace(s, **{key: value}), key) != ours[key]:
                out.append(f"{key}={value} (parity samples with GRPOConfig's {ours[key]})")
        elif key == "max_new_tokens":
            if value != max_new_tokens:
                out.append(f"max_new_tokens={value} (parity stops at max_completion_length="
                           f"{max_new_tokens})")
        elif key not in NEUTRAL and value is not None and value != defaults.get(key):
            out.append(f"{key}={value}")
    return out


def warn_bypassed(items: list[str]) -> None:
    if items:
        logger.warning("parity: its engine samples without model.generate and ignores %s; it "
                       "samples with GRPOConfig's temperature, top_p, top_k, min_p and "
                       "repetition_penalty only (docs/trl.md, Limits)", "; ".join(items))


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                s: Sampling, entropy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last T tokens of each row under the sampling distribution `s`, from the
    `logits` [B, T, V] that predict them, 0 on padding; with `entropy`, that distribution's
    entropy at each of those positions. The sampled token is never cut (`processed_logits`)."""
    T = logits.shape[1]
    tokens, valid = input_ids[:, -T:], attention_mask[:, -T:]
    seen = (seen_before(input_ids[:, :-T], attention_mask[:, :-T], tokens, valid,
                        logits.shape[-1]) if s.penalises else None)
    x = processed_logits(logits, s, keep=tokens, seen=seen)
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    out = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * valid
    if not entropy:
        return out, None
    kept = torch.isfinite(logp)
    return out, -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1) * valid
