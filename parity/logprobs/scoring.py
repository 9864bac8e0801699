"""Log-probs of tokens under the sampling distribution, from logits or from a model's last hidden
state, a chunk of tokens at a time.

From the hidden state (`head_logprobs`), which is how the trainer, the shadow, ℓ_old, the
reference and the audit score: the output projection runs on a chunk of tokens, the chunk's
[tokens, vocabulary] logits become log-probs and are dropped, and with gradient each chunk's
logits are recomputed in its backward rather than kept. So the logits of a whole micro-batch
never exist, at 151,936 tokens of vocabulary 0.6 MB per token in fp32 and two or three times
that in the autograd graph. TRL (`trl/kernels/chunked_logprob.py`) and verl
(`use_fused_kernels`) do the same for a plain softmax; parity's chunks run over tokens and keep
the whole vocabulary in each, because top-k, top-p and min-p need a row's whole distribution.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.utils._device import DeviceContext
from torch.utils.checkpoint import checkpoint

from parity.logprobs.penalty import Seen
from parity.logprobs.sampling import Sampling, processed_logits

# Without gradient, vocabulary-wide work over logits that exist already takes a few positions at
# a time: a float32 temporary of 8 MiB is memory the allocator hands back at once, where one over
# a whole micro-batch is fresh memory each time, on a CPU slower to fill than the arithmetic is
# to run (docs/performance.md). At least a position per thread: each position's reductions then
# run as they do over the whole tensor, to the bit.
CHUNK_BYTES = 8 << 20
# On a GPU the caching allocator reuses memory anyway, and each chunk is several kernel launches:
# chunks there only bound the temporaries' memory.
DEVICE_CHUNK_BYTES = 256 << 20
# fp32 logits per chunk of tokens scored from the hidden state. Each chunk streams the head's
# whole weight ([V, d]) through the product and, with gradient, through its gradient too, so
# chunks of 16 tokens were 1.4-1.7 times slower than the whole micro-batch's logits at once, and
# chunks of 64-512 tokens 0.73-0.90 of its time, at Qwen3's vocabulary on 2 CPU cores
# (`python -m bench.logprob_chunks`, docs/performance.md). A GPU gets larger chunks: its
# products want more rows, and its allocator reuses the memory.
HEAD_CHUNK_BYTES = 128 << 20
DEVICE_HEAD_CHUNK_BYTES = 1 << 30


# The exact KL(μ‖π) keeps the engine's whole distribution, [positions, vocabulary] fp32, for the
# first positions of each of a few rows: as many as this holds per row (110 at Qwen3's
# vocabulary). The default 4 whole rows would hold 2.4 GB per 1,000 tokens there, and the
# trainer's logits of the same positions as much again (docs/performance.md).
RECORDED_BYTES_PER_ROW = 64 << 20


def recorded_positions(vocab: int) -> int:
    """The positions of a recorded row whose whole distribution is kept for the exact KL: the
    first ones, as many as `RECORDED_BYTES_PER_ROW` of fp32 hold."""
    return max(RECORDED_BYTES_PER_ROW // (4 * vocab), 1)


def row_chunk(vocab: int, device: torch.device | None = None) -> int:
    """Positions of a vocabulary-wide computation without gradient that run at once on
    `device` (the CPU when None)."""
    if device is not None and device.type != "cpu":
        return max(DEVICE_CHUNK_BYTES // (4 * vocab), 1)
    return max(CHUNK_BYTES // (4 * vocab), torch.get_num_threads(), 1)


def head_chunk(vocab: int, device: torch.device | None = None) -> int:
    """Tokens scored at once from the hidden state by default on `device` (the CPU when None):
    as many as `HEAD_CHUNK_BYTES` of fp32 logits hold (220 at Qwen3's vocabulary on the CPU)."""
    budget = DEVICE_HEAD_CHUNK_BYTES if device is not None and device.type != "cpu" else \
        HEAD_CHUNK_BYTES
    return max(budget // (4 * vocab), 1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling,
                         keep_sampled: bool = True, seen: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """log p(token) under the sampling distribution defined by `s`; fp32, shape of `tokens`.
    `seen`: as `processed_logits` needs it with a repetition penalty. Without gradient the
    positions run `row_chunk` at a time, with the same result."""
    if (torch.is_grad_enabled() and logits.requires_grad) or tokens.dim() == 0:
        return _logprobs(logits, tokens, s, keep_sampled, seen)
    x, tok = logits.reshape(-1, *logits.shape[-2:]), tokens.reshape(-1, tokens.shape[-1])
    sn = None if seen is None else seen.reshape(x.shape)
    out = torch.empty(tok.shape, dtype=torch.float32, device=logits.device)
    c = row_chunk(logits.shape[-1], logits.device)
    for b in range(x.shape[0]):
        for a in range(0, x.shape[1], c):
            out[b, a:a + c] = _logprobs(x[b, a:a + c], tok[b, a:a + c], s, keep_sampled,
                                        None if sn is None else sn[b, a:a + c])
    return out.reshape(tokens.shape)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling, keep_sampled: bool,
              seen: torch.Tensor | None) -> torch.Tensor:
    x = processed_logits(logits, s, keep=tokens if keep_sampled else None, seen=seen)
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: torch.Tensor,
                  s: Sampling, seen: Seen | None = None, chunk: int = 0,
                  gather: Callable[[], contextlib.AbstractContextManager] | None = None
                  ) -> torch.Tensor:
    """log p(token) of N tokens, [N] fp32, from the last hidden states that predict them
    ([N, d]) and the model's output projection `head`, `chunk` tokens at a time (0:
    `head_chunk`). With gradient (to `hidden` or to the head), each chunk's logits are
    recomputed in the backward; nothing vocabulary-wide outlives its chunk either way. Runs
    under whatever autocast the caller set, as the model's own head would. `gather`: a context
    in which the head's weight is whole, entered around every use of it, the backward's
    recomputation included (a sharded model's: parity/models/forward.py)."""
    n = hidden.shape[0]
    chunk = chunk or head_chunk(head.weight.shape[0], hidden.device)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in head.parameters()))
    parts = []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        args = (head, hidden[a:b], tokens[a:b], s, seen, a, b, gather)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False, context_fn=_forward_modes)
                     if grad else _chunk(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, s: Sampling,
           seen: Seen | None, a: int, b: int,
           gather: Callable[[], contextlib.AbstractContextManager] | None) -> torch.Tensor:
    with gather() if gather is not None else contextlib.nullcontext():
        logits = head(hidden)
    return _logprobs(logits, tokens, s, True, None if seen is None else seen.at(a, b))


def _forward_modes() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's contexts: the recomputation runs under the torch-function modes the chunk's
    forward ran under. The backward starts where torch has popped them, so the fp16 products a
    CPU emulates in float64 (parity/models/precision.py) would otherwise be recomputed natively,
    and differ from the tensors the forward saved."""
    return contextlib.nullcontext(), _entered(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _entered(modes: list) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for mode in modes:
            # The default device's mode stays where torch keeps it: it moves itself to the
            # bottom of the stack and back on entry and exit, so a second entry of it would
            # leave it set for good. Nothing in a chunk is made without a device anyway.
            if not isinstance(mode, DeviceContext):
                stack.enter_context(mode)
        yield
