"""Log-probs scored a chunk of tokens at a time from the last hidden state (parity's default) are
those of the whole sampling distribution: values and gradients against a float64 reference
written independently of parity/logprobs, for every sampling setting and chunk size; then
through real models, with LoRA, gradient checkpointing and fp16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch

from parity.logprobs import Rollout, Sampling, Seen, first_seen, head_logprobs, seen_before

V, D, N = 53, 16, 23

CASES = {
    "plain": Sampling(),
    "temperature 0.7": Sampling(temperature=0.7),
    "top-k 5": Sampling(top_k=5),
    "top-p 0.8, T 1.3": Sampling(top_p=0.8, temperature=1.3),
    "min-p 0.05": Sampling(min_p=0.05),
    "repetition penalty 1.5": Sampling(repetition_penalty=1.5),
    "everything": Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                           repetition_penalty=1.3),
}


def reference_logp(z: torch.Tensor, tokens: torch.Tensor, s: Sampling,
                   seen: list[set[int]] | None) -> torch.Tensor:
    """log p(token) under `s` from float64 logits [N, V], one row at a time, as the sampling
    rules read: penalise the tokens seen, divide by the temperature, keep the top k, the
    smallest set of likeliest tokens whose mass reaches top_p, those at least min_p times the
    likeliest, and always the sampled token."""
    out = []
    for n in range(z.shape[0]):
        scale = torch.ones(z.shape[1], dtype=torch.float64)
        for v in (seen[n] if seen else ()):
            scale[v] = 1 / s.repetition_penalty if z[n, v] > 0 else s.repetition_penalty
        row = z[n] * scale / s.temperature
        values = row.detach().tolist()
        order = sorted(range(len(values)), key=lambda v: -values[v])
        keep = order[:s.top_k] if s.top_k else order
        if s.top_p < 1:
            p = torch.softmax(torch.tensor([values[v] for v in keep], dtype=torch.float64), 0)
            mass, nucleus = 0.0, []
            for v, pv in zip(keep, p.tolist()):
                if mass >= s.top_p:
                    break
                nucleus.append(v)
                mass += pv
            keep = nucleus
        if s.min_p:
            p = torch.softmax(torch.tensor([values[v] for v in keep], dtype=torch.float64), 0)
            keep = [v for v, pv in zip(keep, p.tolist()) if pv >= s.min_p * float(p.max())]
        kept = sorted(set(keep) | {int(tokens[n])})
        out.append(row[int(tokens[n])] - torch.logsumexp(row[kept], 0))
    return torch.stack(out)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(D, V, dtype=torch.float64)
    torch.nn.init.normal_(head.weight, std=0.6, generator=g)
    tokens = torch.randint(0, V, (N,), generator=g)
    return h, head, tokens


def _seen(n_rows: int = 3):
    """A small rollout's penalty bookkeeping for N scored tokens, and the same as sets."""
    g = torch.Generator().manual_seed(1)
    T = (N + n_rows - 1) // n_rows
    prompt = torch.randint(0, V, (n_rows, 4), generator=g)
    pmask = torch.ones_like(prompt)
    pmask[0, :2] = 0                                   # left padding is not seen
    comp = torch.randint(0, V, (n_rows, T), generator=g)
    cmask = (torch.arange(T)[None] < torch.tensor([T, T - 1, T])[:, None]).float()
    rows, pos = cmask.nonzero(as_tuple=True)
    rows, pos = rows[:N], pos[:N]
    sets = [{int(v) for v, m in zip(prompt[b], pmask[b]) if m} | set(comp[b, :t].tolist())
            for b, t in zip(rows.tolist(), pos.tolist())]
    return Seen(first_seen(prompt, pmask, comp, cmask, V), rows, pos), sets, comp[rows, pos], \
        (prompt, pmask, comp, cmask)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [1, 4, N, 0])
def test_chunked_logprobs_and_their_gradients_match_float64(case, chunk):
    s = CASES[case]
    h64, head64, tokens = _batch()
    seen, sets = None, None
    if s.penalises:
        seen, sets, tokens, _ = _seen()
    h = h64.float().requires_grad_(True)
    head = copy.deepcopy(head64).float()
    got = head_logprobs(h, head, tokens, s, seen, chunk)
    w = torch.linspace(-1, 2, N)               # any upstream gradient, not only ones
    (got * w).sum().backward()

    h_ref = h64.clone().requires_grad_(True)
    ref = reference_logp(head64(h_ref), tokens, s, sets)
    (ref * w.double()).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got.double(), ref.detach(), atol=2e-5, rtol=0)
    for mine, theirs in ((h.grad, h_ref.grad), (head.weight.grad, head64.weight.grad),
                         (head.bias.grad, head64.bias.grad)):
        assert float((mine.double() - theirs).norm()) <= 1e-5 * float(theirs.norm()) + 1e-6


def test_the_default_chunks_keep_the_first_logits_and_recompute_the_rest(monkeypatch):
    """With the default chunks, the backward keeps the logits of the first `kept_tokens` and
    recomputes only the chunks after them; values and gradients stay the float64 reference's."""
    from parity.logprobs import scoring
    monkeypatch.setattr(scoring, "HEAD_CHUNK_BYTES", 3 * V * 4)      # chunks of 3 tokens
    monkeypatch.setattr(scoring, "KEPT_LOGITS_BYTES", 8 * V * 4)     # 8 tokens kept: 2 chunks
    s = CASES["everything"]
    h64, head64, _ = _batch()
    seen, sets, tokens, _ = _seen()
    h = h64.float().requires_grad_(True)
    head = copy.deepcopy(head64).float()
    calls = []
    head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    got = head_logprobs(h, head, tokens, s, seen)
    assert len(calls) == 8                      # 23 tokens in chunks of 3
    got.sum().backward()
    assert sorted(calls[8:]) == [2] + [3] * 5   # the six chunks after the kept ones, again
    h_ref = h64.clone().requires_grad_(True)
    ref = reference_logp(head64(h_ref), tokens, s, sets)
    ref.sum().backward()
    torch.testing.assert_close(got.double(), ref.detach(), atol=2e-5, rtol=0)
    for mine, theirs in ((h.grad, h_ref.grad), (head.weight.grad, head64.weight.grad)):
        assert float((mine.double() - theirs).norm()) <= 1e-5 * float(theirs.norm()) + 1e-6


@pytest.mark.parametrize("case", ["plain", "top-p 0.8, T 1.3"])
def test_the_log_softmax_backward_is_autograds_to_the_bit(case):
    """The one-tensor backward of x[token] - logsumexp(x) gives autograd's own gradient of the
    same expression exactly, -inf entries (tokens the sampling removed) included."""
    from parity.logprobs.sampling import processed_logits
    from parity.logprobs.scoring import _LogSoftmaxAt
    h64, head64, tokens = _batch()
    z = head64(h64).float().detach()
    x = processed_logits(z, CASES[case], keep=tokens)
    w = torch.linspace(-1, 2, N)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    mine = _LogSoftmaxAt.apply(a, tokens)
    theirs = b.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(b, dim=-1)
    (mine * w).sum().backward()
    (theirs * w).sum().backward()
    assert torch.equal(mine, theirs) and torch.equal(a.grad, b.grad)


def test_without_gradient_the_chunks_hold_nothing_and_give_the_same_values():
    h64, head64, tokens = _batch()
    head = copy.deepcopy(head64).float()
    with torch.no_grad():
        whole = head_logprobs(h64.float(), head, tokens, Sampling(top_p=0.9), None, N)
        chunked = head_logprobs(h64.float(), head, tokens, Sampling(top_p=0.9), None, 2)
    assert not chunked.requires_grad
    # A chunk of 2 rows may take another fp32 kernel than 23 rows, which sums the D products of
    # each logit in another order: each order is within γ = (D + 1)·u of the exact sum of
    # |h||w| (the bias added), so two differ by up to 2γ of it; the log-prob, z_t less the
    # log-sum-exp, moves by at most twice the largest logit's difference, plus its own rounding.
    # One CPU's kernels differed by 1.9e-6 here; a wrong token or chunk is off by whole nats.
    u = 2.0 ** -24
    mag = h64.abs() @ head64.weight.detach().abs().T + head64.bias.detach().abs()
    bound = 2 * (2 * (D + 1) * u * mag).amax(-1) + u * whole.abs().double()
    assert ((chunked - whole).abs().double() <= bound).all(), (chunked - whole, bound)


def test_the_penalty_bookkeeping_is_what_each_position_has_seen():
    seen, sets, _, (prompt, pmask, comp, cmask) = _seen()
    for n, expected in enumerate(sets):
        assert set(seen.at(n, n + 1)[0].nonzero().flatten().tolist()) == expected
    # the [B, T, V] mask of callers that hold whole logits says the same
    whole = seen_before(prompt, pmask, comp, cmask, V)
    assert torch.equal(whole[seen.rows, seen.pos], seen.at(0, N))


def test_a_batch_with_no_valid_token_scores_nothing():
    h64, head64, _ = _batch()
    out = head_logprobs(h64[:0].float(), copy.deepcopy(head64).float(),
                        torch.zeros(0, dtype=torch.long), Sampling())
    assert out.shape == (0,)


# ---- through real models ----------------------------------------------------------------------

def _rollout(model, tok, s: Sampling) -> Rollout:
    from parity.engines.hf import HFEngine
    prompts = [tok(t)["input_ids"] for t in ("the cat", "a long time ago there was", "why")]
    return HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        prompts * 2, 9, s, torch.Generator().manual_seed(0))


def _reference(model64, r: Rollout, s: Sampling) -> torch.Tensor:
    """[B, T] float64 log-probs from the float64 model's own logits."""
    from parity.logprobs import positions
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask.long()], 1)
    logits = model64(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    T, P = r.completion_ids.shape[1], r.prompt_ids.shape[1]
    valid = r.completion_mask > 0
    rows, pos = valid.nonzero(as_tuple=True)
    sets = None
    if s.penalises:
        sets = [{int(v) for v, m in zip(r.prompt_ids[b], r.prompt_mask[b]) if m}
                | set(r.completion_ids[b, :t].tolist())
                for b, t in zip(rows.tolist(), pos.tolist())]
    flat = reference_logp(logits[rows, P - 1 + pos].double(), r.completion_ids[rows, pos], s,
                          sets)
    assert T == r.completion_mask.shape[1]
    return torch.zeros(valid.shape, dtype=torch.float64).index_put((rows, pos), flat)


MODEL_CASES = ["plain", "lora", "gradient checkpointing", "fp16 autocast"]


@pytest.mark.e2e
@pytest.mark.parametrize("case", MODEL_CASES)
def test_the_trainer_forward_matches_a_float64_model(text_model, case):
    """ℓ_π and its gradient with the default chunks, on a real model (4,096-token vocabulary),
    against the model in float64 scored by the reference above: temperature, top-p and a
    repetition penalty on, chunks of 5 tokens, so a chunk crosses rows."""
    from parity.models import lora
    from parity.models.forward import score_full
    from parity.models.loading import load_policy
    from parity.models.precision import autocast
    s = Sampling(temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    model, tok = load_policy(text_model)
    model.eval()
    if case == "lora":
        model = lora.wrap(model, 4, None, lora.ALL_LINEAR, False, torch.float32)
        for n, p in model.named_parameters():   # adapters away from 0: B starts at zero
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    r = _rollout(model, tok, s)
    model64 = copy.deepcopy(model).double()
    if case == "gradient checkpointing":
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": False})
    dtype = "fp16" if case == "fp16 autocast" else "fp32"
    with autocast(dtype, torch.device("cpu"), "emulate"):
        got = score_full(model, r, s, chunk=5).logp
    w = torch.randn(r.completion_mask.shape, generator=torch.Generator().manual_seed(3))
    (got * w).sum().backward()
    ref = _reference(model64, r, s)
    (ref * w.double()).sum().backward()
    tol = 3e-3 if dtype == "fp16" else 2e-5
    assert float((got.detach().double() - ref.detach()).abs().max()) <= tol
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), model64.parameters())
             if p.requires_grad]
    assert grads and all(g is not None for g, _ in grads)
    num = sum(float((g.double() - h).norm()) ** 2 for g, h in grads) ** 0.5
    den = sum(float(h.norm()) ** 2 for _, h in grads) ** 0.5
    assert num <= (3e-2 if dtype == "fp16" else 1e-4) * den, (num, den)


def test_the_backward_leaves_the_default_device_as_it_was():
    """A run's tensors carry their device (tests/test_devices.py sets `meta` as the default):
    the chunks' recomputation in the backward neither needs the default nor changes it."""
    h64, head64, tokens = _batch()
    h, head = h64.float().requires_grad_(True), copy.deepcopy(head64).float()
    torch.set_default_device("meta")
    try:
        head_logprobs(h, head, tokens, Sampling(top_k=5), None, 4).sum().backward()
    finally:
        torch.set_default_device(None)
    assert torch.get_default_device().type == "cpu" and h.grad.device.type == "cpu"
