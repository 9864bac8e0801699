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
# whole weight ([V, d]) through the product and, with gradient, through its gradient too: the
# smaller the chunk, the more often (`python -m bench.logprob_chunks`, docs/performance.md). A GPU
# gets larger chunks: its products want more rows, and its allocator reuses the memory.
HEAD_CHUNK_BYTES = 128 << 20
DEVICE_HEAD_CHUNK_BYTES = 1 << 30
# With gradient and the default chunks, the first chunks' logits are kept for the backward, as
# many as this holds of fp32 (1,766 tokens at Qwen3's vocabulary), and only the chunks after them
# are recomputed in it. The recomputation is one more product with the head and one more
# log-softmax per token: on 2 CPU cores, with every chunk recomputed the head's forward and
# backward took 1.47-1.66 times the whole logits' time in fp32, with every chunk kept (4 x 256
# tokens) 1.04-1.05 times (the same bench, docs/performance.md).
KEPT_LOGITS_BYTES = 1 << 30


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


def kept_tokens(vocab: int) -> int:
    """Tokens whose logits the default chunks keep for the backward rather than recompute."""
    return KEPT_LOGITS_BYTES // (4 * vocab)


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


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension, a row's bits the same however many rows there are.
    torch reduces a lone row across its threads, in another order than the one thread per row
    it gives two or more (a single row of Qwen3's vocabulary: bench.row_invariance), so a lone
    row is reduced beside a copy of itself."""
    if x.numel() and x.numel() == x.shape[-1]:
        return torch.logsumexp(torch.cat([x.reshape(1, -1)] * 2), dim=-1)[:1].reshape(
            x.shape[:-1])
    return torch.logsumexp(x, dim=-1)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x - logsumexp(x) over the last dimension: the log-softmax an engine samples from, the
    same function as the trainer's log-prob of a token (`_LogSoftmaxAt`), so that where both
    compute the same logits they give the same log-probs to the bit (torch's fused
    log_softmax rounds otherwise; docs/zero-mismatch.md)."""
    return x - logsumexp(x).unsqueeze(-1)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, s: Sampling, keep_sampled: bool,
              seen: torch.Tensor | None) -> torch.Tensor:
    x = processed_logits(logits, s, keep=tokens if keep_sampled else None, seen=seen)
    return _LogSoftmaxAt.apply(x, tokens)


class _LogSoftmaxAt(torch.autograd.Function):
    """x[token] - logsumexp(x) over the last dimension, with a backward that writes the
    gradient, g·(onehot(token) - softmax(x)), into one tensor in place. Autograd's own backward of
    the same expression makes five [tokens, vocabulary] tensors (the logsumexp's difference, its
    exponential and product, the gather's zeros, their sum): on a CPU each is fresh memory,
    slower to fill than the arithmetic is to run. The values are the same to the bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        lse = logsumexp(x)
        ctx.save_for_backward(x, tokens, lse)
        return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, tokens, lse = ctx.saved_tensors
        grad = (x - lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
        return grad.scatter_add_(-1, tokens.unsqueeze(-1), g.unsqueeze(-1)), None


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: torch.Tensor,
                  s: Sampling, seen: Seen | None = None, chunk: int = 0,
                  gather: Callable[[], contextlib.AbstractContextManager] | None = None
                  ) -> torch.Tensor:
    """log p(token) of N tokens, [N] fp32, from the last hidden states that predict them
    ([N, d]) and the model's output projection `head`, `chunk` tokens at a time (0:
    `head_chunk`). With gradient (to `hidden` or to the head), each chunk's logits are
    recomputed in the backward, but for the default chunks' first `kept_tokens`, whose logits
    the backward keeps (none under `gather`); without gradient nothing vocabulary-wide outlives
    its chunk. Runs
    under whatever autocast the caller set, as the model's own head would. `gather`: a context
    in which the head's weight is whole, entered around every use of it, the backward's
    recomputation included (a sharded model's: parity/models/forward.py)."""
    n, vocab = hidden.shape[0], head.weight.shape[0]
    # A gathered head's whole weight is freed again after the forward: a chunk kept for the
    # backward would have lost the weight it saved, so under `gather` every chunk is recomputed.
    kept = 0 if chunk or gather is not None else kept_tokens(vocab)
    chunk = chunk or head_chunk(vocab, hidden.device)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in head.parameters()))
    parts = []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        args = (head, hidden[a:b], tokens[a:b], s, seen, a, b, gather)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False, context_fn=_forward_modes)
                     if grad and b > kept else _chunk(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, s: Sampling,
           seen: Seen | None, a: int, b: int,
           gather: Callable[[], contextlib.AbstractContextManager] | None) -> torch.Tensor:
    with gather() if gather is not None else contextlib.nullcontext():
        logits = head(hidden)
    # without gradient, the vocabulary-wide work over the chunk's logits runs `row_chunk`
    # positions at a time, as over any logits
    return logprobs_from_logits(logits, tokens, s, True, None if seen is None else seen.at(a, b))


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
