"""The log-prob math every engine and the trainer share, below both: the sampling distribution
(parity/logprobs/sampling.py), the repetition penalty's bookkeeping (penalty.py), log-probs from
logits or from a model's last hidden state a chunk of tokens at a time (scoring.py), and the
batch they score (batch.py). It imports neither parity/engines nor parity/models."""

from parity.logprobs.batch import Rollout, keep_last, left_pad, positions
from parity.logprobs.penalty import Seen, first_seen, prompt_tokens, see, seen_before
from parity.logprobs.sampling import TOP_TOKEN_ONLY, Sampling, processed_logits
from parity.logprobs.scoring import (
    head_chunk,
    head_logprobs,
    kept_tokens,
    log_softmax,
    logprobs_from_logits,
    recorded_positions,
    row_chunk,
)

__all__ = ["TOP_TOKEN_ONLY", "Rollout", "Sampling", "Seen", "first_seen", "head_chunk",
           "head_logprobs", "keep_last", "kept_tokens", "left_pad", "log_softmax",
           "logprobs_from_logits",
           "positions", "processed_logits", "prompt_tokens", "recorded_positions", "row_chunk",
           "see", "seen_before"]
