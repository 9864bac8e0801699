"""The invariant kernels (parity/models/invariant.py, the row padding in parity/cpu_bf16.py):
each op gives a row the same bits whatever else is in the batch, checked with torch.equal;
their values against float64; the trainer's forward in the engine's dtype carries the gradient
to the fp32 weights; and parity's engine with them samples log-probs that the trainer, at any
micro-batch and either padding, reproduces to the bit, on the Llama, Qwen2, Qwen3, GPT-2,
Qwen3-MoE and Mixtral families. With the padding off the same checks fail on CPUs whose BLAS
picks its kernel by the row count (`python -m bench.row_invariance` says which here)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from parity import cpu_bf16
from parity.config import make_config
from parity.engines.hf import HFEngine
from parity.errors import ParityError
from parity.logprobs import Sampling
from parity.models import invariant
from parity.models.forward import pieces, score_full, score_pieces, score_right_padded
from parity.models.precision import low_precision_copy

DTYPES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False),
          "bf16 emulated": (torch.bfloat16, True)}


@contextlib.contextmanager
def padded(dtype_case: str):
    _, emulate = DTYPES[dtype_case]
    with cpu_bf16.kernels(emulate=emulate or cpu_bf16.active(), tile=invariant.TILE):
        yield


# (out, in): the second is a shape where oneDNN's bf16 kernels on a CPU with AMX change their
# order of sums at 48 to 336 rows, and a batched product's with the batch count
@pytest.mark.parametrize("shape", [(384, 160), (576, 1536)])
@pytest.mark.parametrize("case", DTYPES)
def test_a_padded_product_gives_each_row_the_same_bits_at_any_row_count(case, shape):
    dtype = DTYPES[case][0]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype)
    x = torch.randn(300, shape[1], generator=g).to(dtype)
    with padded(case):
        # each op against itself at the whole batch: a model's product takes the same op on
        # both sides (mm and bmm may differ from each other, as their kernels do)
        whole, product = F.linear(x, w, b), torch.mm(x, w.t())
        batched = torch.bmm(x[None].expand(3, -1, -1), w.t()[None].expand(3, -1, -1))
        for m in (1, 2, 3, 5, 7, 16, 17, 33, 64, 130, 300):
            assert torch.equal(F.linear(x[:m], w, b), whole[:m]), m
            assert torch.equal(torch.mm(x[:m], w.t()), product[:m]), m
            assert torch.equal(torch.bmm(x[None, :m], w.t()[None])[0], batched[1, :m]), m
    exact = x.double() @ w.double().t() + b.double()
    tol = 2 ** -7 if dtype is torch.bfloat16 else 1e-5   # a bf16 result's half-ulp, relative
    assert torch.allclose(whole.double(), exact, rtol=tol, atol=tol * exact.abs().max())


def _attention(q, k, v, mask):
    return invariant.invariant_attention(torch.nn.Module(), q, k, v, mask)[0]


def _mask(valid: torch.Tensor, q: int) -> torch.Tensor:
    """eager's additive [B, 1, q, L] mask: causal over the last q positions, padding masked."""
    B, L = valid.shape
    i = torch.arange(q)[:, None] + (L - q)
    see = (torch.arange(L)[None] <= i)[None] & valid[:, None].bool()
    return torch.where(see, 0.0, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gives_a_query_the_same_bits_in_decode_prefill_and_any_padding(dtype):
    """A query's output depends on its own keys only: the decode step of token t against t + 1
    cached keys, the whole sequence's prefill, the sequence left-padded by 5 or 70 positions
    (across a block boundary) and right-padded, all equal; against float64 attention."""
    g = torch.Generator().manual_seed(1)
    H, kv, d, T = 4, 2, 16, 150
    q = torch.randn(1, H, T, d, generator=g).to(dtype)
    k = torch.randn(1, kv, T, d, generator=g).to(dtype)
    v = torch.randn(1, kv, T, d, generator=g).to(dtype)
    with padded("fp32"):
        full = _attention(q, k, v, _mask(torch.ones(1, T), T))          # [1, T, H, d]
        noise = lambda x, n: torch.randn(*x.shape[:2], n, d, generator=g).to(dtype)
        for pad in (5, 70):
            z = lambda x, pad=pad: torch.cat([noise(x, pad), x], 2)
            valid = torch.cat([torch.zeros(1, pad), torch.ones(1, T)], 1)
            left = _attention(z(q), z(k), z(v), _mask(valid, pad + T))[:, pad:]
            assert torch.equal(left, full), pad
        r = lambda x: torch.cat([x, noise(x, 30)], 2)
        right = _attention(r(q), r(k), r(v), _mask(torch.cat([torch.ones(1, T),
                                                              torch.zeros(1, 30)], 1), T + 30))
        assert torch.equal(right[:, :T], full)
        for t in (0, 1, 63, 64, 100, T - 1):
            step = _attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                              _mask(torch.ones(1, t + 1), 1))
            assert torch.equal(step[:, 0], full[:, t]), t
    # float64: softmax(q kᵀ / √d) v with the causal mask, GQA's heads sharing key heads
    kk, vv = (x.double().repeat_interleave(H // kv, 1) for x in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / d ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    exact = (s.softmax(-1) @ vv).transpose(1, 2)
    tol = 2 ** -8 if dtype is torch.bfloat16 else 1e-6
    assert torch.allclose(full.double(), exact, rtol=tol, atol=tol)


def test_attention_over_blocks_of_queries_gives_the_same_bits_and_gradient(monkeypatch):
    """The queries go QUERIES at a time, each block recomputed in the backward: the output is
    the one-block output's bits, and the gradient its value up to the order of its sums."""
    g = torch.Generator().manual_seed(3)
    H, kv, d, T = 4, 2, 16, 150
    x = [torch.randn(1, n, T, d, generator=g).requires_grad_() for n in (H, kv, kv)]
    up = torch.randn(1, T, H, d, generator=g)
    results = []
    for blocks in (1024, 32):      # one block of queries; five, the last of 22
        monkeypatch.setattr(invariant, "QUERIES", blocks)
        with padded("fp32"):
            out = _attention(*x, _mask(torch.ones(1, T), T))
        grads = torch.autograd.grad((out * up).sum(), x)
        results.append((out.detach(), grads))
    (one, g1), (many, g2) = results
    assert torch.equal(one, many)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_trainer_forward_in_engine_precision_carries_the_gradient_to_fp32():
    """Inside engine_precision the model computes what its bf16 copy computes, bit for bit,
    and the fp32 weights get that copy's gradient; parameters() stays fp32; an exception inside
    leaves the model as it was."""
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, tie_word_embeddings=True))
    copy_ = low_precision_copy(m, "bf16")   # the engine's copy: RoPE's tables kept in fp32
    for p in copy_.parameters():
        p.requires_grad_(True)
    x = torch.randint(0, 64, (2, 9))
    with invariant.engine_precision(m, torch.bfloat16):
        assert all(p.dtype is torch.float32 for p in m.parameters())
        out = m(x).logits
    ref = copy_(x).logits
    assert out.dtype is torch.bfloat16 and torch.equal(out, ref)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    for (n, p), q in zip(m.named_parameters(), copy_.parameters()):
        assert p.grad.dtype is torch.float32 and torch.equal(p.grad, q.grad.float()), n
    with pytest.raises(RuntimeError), invariant.engine_precision(m, torch.bfloat16):
        raise RuntimeError
    assert m.model.embed_tokens.weight.dtype is torch.float32 and "weight" not in vars(m.lm_head)
    assert m(x).logits.dtype is torch.float32


# wide enough heads (32) that an fp32 product's kernel depends on its row count here
BODY = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: tf.LlamaConfig(**BODY),
    "qwen2": lambda: tf.Qwen2Config(**BODY),
    "qwen3": lambda: tf.Qwen3Config(**BODY, head_dim=32),
    "gpt2": lambda: tf.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4,
                                  n_positions=256),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**BODY, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=64, norm_topk_prob=True,
                                           head_dim=32),
    "mixtral": lambda: tf.MixtralConfig(**BODY, num_local_experts=6, num_experts_per_tok=2),
}


def _rollout(family: str, tile: int, dtype: str = "bf16"):
    torch.manual_seed(0)
    master = tf.AutoModelForCausalLM.from_config(FAMILIES[family.removesuffix("+lora")]()).eval()
    if family.endswith("+lora"):    # unmerged adapters, B random so that they change the output
        from parity.models import lora
        master = lora.wrap(master, 4, None, "all-linear", False, torch.float32)
        with torch.no_grad():
            for n, p in master.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    invariant.use(master)
    cpu_bf16.pad_rows(tile)
    engine = HFEngine(master, dtype, eos_id=999, pad_id=0)
    prompts = [[5, 6, 7], list(range(8, 20)), [15], [16, 17, 18, 19, 20]]
    r = engine.generate(prompts, 100, Sampling(temperature=0.9),
                        torch.Generator().manual_seed(0))
    return master, r


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3+lora"])
def test_the_trainer_reproduces_the_engines_log_probs_bit_for_bit(family):
    """The engine's ℓ_μ, sampled token by token in bf16, against the trainer's forward in
    engine precision: the whole batch, one completion at a time, and right-padded."""
    was = cpu_bf16.padding()
    try:
        master, r = _rollout(family, invariant.TILE)
        s, mask = Sampling(temperature=0.9), r.completion_mask > 0
        assert int(mask.sum()) > 100
        with torch.no_grad(), invariant.engine_precision(master, torch.bfloat16):
            for logp in (score_full(master, r, s).logp,
                         score_pieces(master, r, s, pieces(r, rows=1)).logp,
                         score_right_padded(master, r, s)):
                assert torch.equal(logp[mask], r.engine_logprobs[mask])
    finally:
        cpu_bf16.pad_rows(was)


def test_the_recipe_is_refused_where_it_cannot_hold():
    base = dict(model="text-xs", recipe="bitwise")
    assert make_config(base).kernels == "invariant"
    assert make_config({**base, "lora_rank": 4, "lora_merge": False}).lora_rank == 4
    for extra, said in ((dict(engine="vllm"), "engine=vllm runs its own kernels"),
                        (dict(trainer_dtype="fp32"), "trainer_dtype=fp32 must be engine_dtype"),
                        (dict(lora_rank=4), "needs --no-lora-merge"),
                        (dict(parallel="fsdp"), "does not hold with --parallel fsdp yet")):
        with pytest.raises(ParityError, match=said):
            make_config({**base, **extra})


def test_a_step_whose_figures_are_not_zero_says_which_forwards_differ(capsys):
    from parity import metric_names as mn
    from parity.trainer import _check_bitwise
    _check_bitwise(4, {mn.KL_K3: 0.0, mn.KERNEL_GAP_ABS_MEAN: 0.0, mn.BETA_ABS_MAX: 0.0})
    assert capsys.readouterr().err == ""
    _check_bitwise(4, {mn.KL_K3: 0.0, mn.KERNEL_GAP_ABS_MEAN: 2e-9, mn.BETA_ABS_MAX: 1e-3})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 4: mismatch/kernel_gap_abs_mean = 2e-09, not 0" in err[0]
    assert "the shadow at the first update against the engine's decode differ" in err[0]
    # a stale rollout's gap to the engine holds the updates it missed; one set of weights still
    # judges the trainer against the shadow
    stale = {mn.ASYNC_STALENESS: 1, mn.KL_K3: 3e-4, mn.BETA_ABS_MAX: 0.0}
    _check_bitwise(4, stale)
    assert capsys.readouterr().err == ""
    _check_bitwise(4, {**stale, mn.BETA_ABS_MAX: 1e-3})
    assert "beta_abs_max = 0.001, not 0: the trainer against the shadow" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [
    (), ("--objective", "gspo", "--lora-rank", "4", "--no-lora-merge"),
    # every log-prob chunk and every layer recomputed in the backward
    ("--objective", "ppo-value", "--logprob-chunk", "8", "--gradient-checkpointing"),
    ("--lm-head-fp32",)],
                         ids=["grpo", "gspo+lora", "ppo-value+recomputed", "fp32-head"])
def test_a_bitwise_run_has_no_gap_at_any_step(tmp_path, text_model, extra):
    import json

    from cli_helpers import run_main
    from parity import metric_names as mn
    before = cpu_bf16.padding()
    p = run_main("train", "--model", str(text_model), "--recipe", "bitwise", "--steps", "3",
                 "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens",
                 "16", "--no-progress", "--out", tmp_path / "run", *extra)
    assert p.returncode == 0, p.stderr
    assert cpu_bf16.padding() == before     # the run's padding ends with it, in this process
    assert "kernels=invariant:" not in p.stderr
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    for m in steps:
        for k in (mn.BETA_ABS_MAX, mn.KL_K3, mn.KL_EXACT, mn.KERNEL_GAP_ABS_MEAN, mn.PHANTOM_FRAC,
                  mn.CLIP_FRAC if m[mn.STEP] == 1 else mn.BETA_MEAN):
            assert m[k] == 0, (m[mn.STEP], k, m[k])
    assert steps[-1][mn.REWARD_MEAN] != steps[0][mn.REWARD_MEAN]   # it trained


@pytest.mark.e2e
def test_a_bitwise_run_with_the_engine_in_its_own_process_has_no_gap(tmp_path, text_model):
    """The asynchronous engine samples in another process, on its own threads: with the
    trainer's padding installed there, a rollout on the trainer's weights (staleness 0) is the
    trainer's bits, and a stale one differs only by the updates it missed."""
    import json

    from cli_helpers import run_main
    from parity import metric_names as mn
    # 2 rows: few enough that an unpadded fp32 product takes another kernel on some CPUs; 32
    # tokens and lr 1e-2, so that the first update moves the policy
    p = run_main("train", "--model", str(text_model), "--recipe", "bitwise", "--steps", "3",
                 "--prompts-per-step", "1", "--samples-per-prompt", "2", "--max-new-tokens",
                 "32", "--async-engine", "--max-staleness", "1", "--lr", "1e-2", "--no-progress",
                 "--out", tmp_path / "run")
    assert p.returncode == 0, p.stderr
    assert "kernels=invariant:" not in p.stderr
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m[mn.ASYNC_STALENESS] for m in steps] == [0, 1, 1]
    for k in (mn.BETA_ABS_MAX, mn.KL_K3, mn.KL_EXACT, mn.KERNEL_GAP_ABS_MEAN, mn.PHANTOM_FRAC,
              mn.CLIP_FRAC):
        assert steps[0][k] == 0, k
    assert all(m[mn.BETA_ABS_MAX] == 0 for m in steps)   # the trainer is the shadow's bits
    assert steps[1][mn.KL_K3] > 0   # sampled before the first update: the policy moved


def test_a_lone_rows_log_sum_exp_is_its_bits_in_a_batch():
    """torch reduces a lone row across its threads, in another order than it reduces a row of
    a batch; parity's logsumexp gives the lone row the batch's bits, in two threads."""
    from parity.logprobs.scoring import logsumexp
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # rows 0 and 9 of these are ones whose lone reduction by torch differs, on the CPU this
        # was written on
        g = torch.Generator().manual_seed(2)
        x = torch.randn(16, 151936, generator=g) * 3
        whole = logsumexp(x)
        assert torch.equal(whole, torch.logsumexp(x, -1))   # a batch: torch's own kernel
        for i in range(16):
            assert torch.equal(logsumexp(x[i:i + 1].clone()), whole[i:i + 1]), i
            assert torch.equal(logsumexp(x[i].clone()), whole[i]), i
    finally:
        torch.set_num_threads(threads)


def test_the_trl_trainers_refuse_the_recipe_they_cannot_run():
    """TRL's trainers take a recipe's precisions and ratio source, not parity's kernels: the
    bitwise recipe there would be bf16 on both sides, silently not bitwise."""
    from parity.config import recipe
    assert recipe("bf16-shadow", "the TRL trainers").name == "bf16-shadow"
    with pytest.raises(ParityError, match="recipe 'bitwise' needs kernels=invariant, which the "
                                          "TRL trainers do not run yet"):
        recipe("bitwise", "the TRL trainers")
    with pytest.raises(ParityError, match="unknown recipe 'fp64'"):
        recipe("fp64")
