"""The sampling distribution every engine draws from and the trainer scores under.

Every engine records, for every sampled token, ℓ_μ: its log-prob under the distribution actually
sampled from (repetition penalty, temperature, top-k, top-p and min-p applied, renormalised).
The trainer scores tokens under the same `processed_logits`, so with equal weights and equal
precision ℓ_π = ℓ_μ up to kernel noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# top_p=0 keeps the likeliest token alone, as transformers' top-p does (min_tokens_to_keep=1).
# vLLM refuses 0 (its range is (0, 1]) but, like parity and transformers, keeps exactly the
# likeliest token at any top_p below that token's probability, which is at least 1/vocabulary:
# this one value means the same to every engine.
TOP_TOKEN_ONLY = 1e-9


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.top_p == 0:
            object.__setattr__(self, "top_p", TOP_TOKEN_ONLY)

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def penalises(self) -> bool:
        """A token's logit depends on the tokens before it, not on the model alone."""
        return self.repetition_penalty != 1.0


def processed_logits(logits: torch.Tensor, s: Sampling, keep: torch.Tensor | None = None,
                     seen: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits of the sampling distribution, in transformers' order: the repetition penalty,
    temperature, top-k, top-p, min-p; removed tokens get -inf. The penalty divides a positive
    logit and multiplies a negative one for every token in `seen` (bool, the shape of `logits`:
    parity/logprobs/penalty.py). `keep` (token ids, shape logits[..., 0]) is never removed: the
    trainer must not score a token the engine really sampled as impossible just because its own
    logits put it a hair outside the nucleus."""
    x = logits.float()
    if s.penalises:
        if seen is None:
            raise ValueError("a repetition penalty needs the tokens seen before each position")
        p = s.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if s.temperature != 1.0:   # at 1 a division would copy the logits for nothing
        x = x / s.temperature
    if not s.truncates:
        return x
    remove = torch.zeros_like(x, dtype=torch.bool)
    if s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        remove |= x < kth
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x.masked_fill(remove, float("-inf")), dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        cut = probs.cumsum(-1) - probs >= s.top_p
        cut[..., 0] = False   # the likeliest token stays, whatever top_p (transformers' rule)
        remove |= torch.zeros_like(remove).scatter(-1, order, cut)
    if s.min_p > 0.0:
        probs = x.masked_fill(remove, float("-inf")).softmax(-1)
        remove |= probs < s.min_p * probs.amax(-1, keepdim=True)
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return x.masked_fill(remove, float("-inf"))
