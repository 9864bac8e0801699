"""The `vllm` engine as itself: vLLM's CPU build in this process, on a testbed model. The
Engine protocol both engines implement, the weight sync, seeds, whole distributions, the
engine-scored shadow, and training and resuming through the command line."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

from parity.engines import Engine
from parity.engines.hf import HFEngine
from parity.logprobs import Sampling
from parity.models.forward import score, score_full
from parity.models.loading import load_policy as load_model
from vllm_helpers import (
    NUDGES,
    moved_copy,
    nudged_op_is_named,
    prompts_of,
    resume,
    row_seed,
    trace_is_vllms_own,
    train,
    vllm_engine,
    whole_distribution,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vllm_ready")]


@pytest.fixture(scope="module")
def master(text_model):
    model, tok = load_model(text_model)
    return model.eval(), tok


@pytest.fixture(scope="module")
def engine(master, text_model):
    yield from vllm_engine(*master, text_model)


def test_both_engines_implement_the_engine_protocol(master, engine):
    model, tok = master
    hf = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id)
    for eng in (hf, engine):
        assert isinstance(eng, Engine)
        for name in ("sync", "load_state", "save_weights", "restore_weights", "weight_bytes",
                     "generate", "score", "trace", "replica", "close"):
            want = inspect.signature(getattr(Engine, name)).parameters
            got = inspect.signature(getattr(type(eng), name)).parameters
            assert list(got)[:len(want)] == list(want), (type(eng).__name__, name)


@pytest.mark.parametrize("s", [Sampling(0.7, 1.0, 20),
                               Sampling(0.9, min_p=0.05, repetition_penalty=1.5)])
def test_samples_carry_processed_logprobs_the_trainer_recomputes(master, engine, s):
    """At T = 0.7 with top-k 20, or with min-p and a repetition penalty, vLLM's ℓ_μ is the
    log-prob under the processed distribution: an fp32 trainer forward scoring the same tokens
    the same way lands within the bf16 gap of it, while the raw model's log-probs are far
    off."""
    model, tok = master
    r = engine.generate(prompts_of(tok), 24, s, torch.Generator().manual_seed(1))
    mask = r.completion_mask
    assert mask.sum() > 40
    assert (r.engine_logprobs[mask == 0] == 0).all()
    processed = score(model, r, s)
    raw = score(model, r, Sampling())
    gap = ((processed - r.engine_logprobs).abs() * mask).sum() / mask.sum()
    off = ((raw - r.engine_logprobs).abs() * mask).sum() / mask.sum()
    assert gap < 0.05 and off > 5 * gap, (float(gap), float(off))


def test_top_p_0_keeps_the_likeliest_token_in_vllm_as_in_parity(master, engine):
    """vLLM refuses top_p=0; parity hands it a top-p below any token's probability, with which
    vLLM keeps the likeliest token alone, as transformers and parity's own engine do at 0: every
    sampled token has ℓ_μ = 0 (a distribution of one token), and the trainer scores it so."""
    model, tok = master
    s = Sampling(top_p=0.0)
    r = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(1))
    mask = r.completion_mask > 0
    assert mask.sum() > 20
    assert (r.engine_logprobs == 0).all()
    sc = score_full(model, r, s, keep_logits=list(range(len(r.completion_ids))))
    logits, sampled = sc.logits[mask], r.completion_ids[mask]
    mine = logits.argmax(-1) == sampled
    assert (sc.logp[mask][mine] == 0).all() and mine.float().mean() > 0.9
    # Where the fp32 trainer's likeliest token is another, vLLM's bf16 forward ordered two
    # tokens whose logits lie within bf16's rounding of each other (a CPU with AMX rounds
    # otherwise than one without: both happen on the testbed's model).
    top = logits.max(-1).values[~mine]
    gap = top - logits[~mine].gather(-1, sampled[~mine, None]).squeeze(-1)
    assert (gap < 0.02 * top.abs()).all(), gap


def test_seeds_make_rows_reproducible_in_any_piece(master, engine):
    """A row's completion depends on the step's generator and its place in the batch, not on
    how many prompts vLLM is given at once (ranks, --rollout-batch, resumes)."""
    model, tok = master
    ps = prompts_of(tok) * 2
    a = engine.generate(ps, 16, Sampling(), torch.Generator().manual_seed(5))
    b = engine.generate(ps, 16, Sampling(), torch.Generator().manual_seed(5), max_batch=5)
    c = engine.generate(ps, 16, Sampling(), torch.Generator().manual_seed(6))
    assert a.completions() == b.completions()
    assert a.completions() != c.completions()
    # the copies of one prompt are different samples
    assert a.completions()[:8] != a.completions()[8:]


@pytest.mark.parametrize("s", [Sampling(), Sampling(0.7, 0.9, 20, min_p=0.05,
                                                    repetition_penalty=1.3)])
def test_recorded_rows_are_the_distribution_vllm_samples_from(master, engine, s):
    """The exact KL's rows, read from vLLM's sampler as tensors, are bit for bit what vLLM
    itself returns as Python objects when asked for every token's log-prob (`logprobs=-1`,
    the same seeds, so the same tokens), -inf where top-k, top-p or min-p excluded a token."""
    model, tok = master
    prompts = prompts_of(tok)
    r = engine.generate(prompts, 12, s, torch.Generator().manual_seed(2), record_rows=[1, 6])
    assert r.dist_rows.tolist() == [1, 6]
    for k, row in enumerate([1, 6]):
        tokens, ref = whole_distribution(engine, prompts[row], s, row_seed(2, row, len(prompts)),
                                         12, tok.eos_token_id)
        n = int(r.completion_mask[row].sum())
        assert tokens == r.completions()[row] and ref.shape[0] == n
        assert torch.equal(r.dists[k, :n], ref)
        assert torch.isinf(r.dists[k, n:]).all()
        if s.top_k:
            assert (torch.isfinite(ref).sum(-1) <= 20).all()


def test_rows_are_recorded_at_their_first_positions_only(master, engine, monkeypatch):
    """The exact KL's rows hold the first `recorded_positions` positions (3 here), the same
    values as a recording without the bound, and a longer row is not dropped for it."""
    from parity.logprobs import scoring
    model, tok = master
    prompts = prompts_of(tok)
    whole = engine.generate(prompts, 12, Sampling(), torch.Generator().manual_seed(2),
                            record_rows=[1, 6])
    monkeypatch.setattr(scoring, "RECORDED_BYTES_PER_ROW", 3 * 4 * model.config.vocab_size)
    r = engine.generate(prompts, 12, Sampling(), torch.Generator().manual_seed(2),
                        record_rows=[1, 6])
    assert r.completions() == whole.completions() and r.dist_rows.tolist() == [1, 6]
    assert r.dists.shape == (2, 3, model.config.vocab_size)
    assert torch.equal(r.dists, whole.dists[:, :3])


@torch.no_grad()
def test_exact_kl_of_both_engines_against_float64(master, engine):
    """mismatch/kl_exact's arithmetic on what each engine keeps, against KL(μ‖π) summed in
    float64 over the whole vocabulary by a second formulation: μ from vLLM's `logprobs=-1`
    objects, or from a float64 copy of the model for parity's own engine in fp32; π from the
    trainer's fp32 forward. The rows must line up with the tokens: one position off and the
    sums disagree."""
    from parity.diagnostics import exact_kl_of_rows
    model, tok = master
    prompts, s, rows = prompts_of(tok), Sampling(), [0, 5]
    wide = type(model)(model.config).double().eval()
    wide.load_state_dict(model.state_dict())
    for eng in (HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id), engine):
        r = eng.generate(prompts, 12, s, torch.Generator().manual_seed(3), record_rows=rows)
        logits = score_full(model, r, s, keep_logits=rows).logits
        got = exact_kl_of_rows(r, logits, rows, r.completion_mask[rows], s)
        ref = []
        for k, row in enumerate(rows):
            n = int(r.completion_mask[row].sum())
            if eng is engine:
                _, whole = whole_distribution(engine, prompts[row], s,
                                              row_seed(3, row, len(prompts)), 12,
                                              tok.eos_token_id)
                mu = [dict(enumerate(x.tolist())) for x in whole]
            else:
                seq = torch.tensor([prompts[row] + r.completions()[row]])
                w = torch.log_softmax(wide(input_ids=seq).logits[0, len(prompts[row]) - 1:-1], -1)
                mu = [dict(enumerate(x.tolist())) for x in w]
            for t in range(n):
                pi = torch.log_softmax(logits[k, t].double(), -1).tolist()
                ref.append(sum(math.exp(m) * (m - pi[v]) for v, m in mu[t].items()
                               if math.isfinite(m)))
        assert got.shape == (len(ref),)
        # fp32 against fp32 leaves rounding of 1e-7 either side of 0; a row one position off
        # would be off by the gap between two positions' distributions, O(1) here
        assert torch.allclose(got, torch.tensor(ref, dtype=got.dtype), rtol=1e-3, atol=1e-6)
    # vLLM's bf16 is not the trainer's fp32: a gap (2e-5 a position here) well above the
    # tolerance, so its rows were checked at rtol 1e-3
    assert float(got.mean()) > 5e-6


def test_sync_changes_what_vllm_serves_to_the_new_weights(master, engine):
    """After a sync from moved master weights, vLLM's log-probs are the new weights' (within
    the bf16 kernel gap of parity's own bf16 forward) and far from the old ones'."""
    model, tok = master
    moved = moved_copy(model)
    s = Sampling()
    before = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(3))
    changed = engine.sync(moved)
    assert 0.1 < changed <= 1.0
    try:
        after = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(3))
        mask = after.completion_mask
        bf16_new = HFEngine(moved, "bf16", tok.eos_token_id, tok.pad_token_id).score(
            moved, after, s)
        old = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id).score(model, after, s)
        to_new = ((bf16_new - after.engine_logprobs).abs() * mask).sum() / mask.sum()
        to_old = ((old - after.engine_logprobs).abs() * mask).sum() / mask.sum()
        assert to_new < 0.05 and to_old > 4 * to_new, (float(to_new), float(to_old))
        assert before.completions() != after.completions()
    finally:
        engine.sync(model)


def test_engine_scored_shadow_is_the_samplers_own_arithmetic(master, engine):
    """vLLM scoring finished sequences on the weights it sampled with gives back the log-probs
    it recorded while decoding (docs/vllm.md): a shadow with no kernel gap."""
    model, tok = master
    s = Sampling()
    r = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(4))
    scored = engine.score(model, r, s)
    mask = r.completion_mask
    assert ((scored - r.engine_logprobs).abs() * mask).max() < 1e-5
    # the next rollout samples from the synced weights again, not the scored ones
    again = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(4))
    assert again.completions() == r.completions()


def test_vllms_trace_is_its_own_forward_under_the_trainers_point_names(master, engine):
    """vLLM traced op by op (`parity audit --locate`): every point of the trainer's trace at
    the same shape, and the traced logits are the very ones vLLM scores the sequence with (its
    prompt log-probs)."""
    trace_is_vllms_own(*master, engine)


@pytest.mark.parametrize("name,first", NUDGES)
def test_a_nudged_op_in_vllm_changes_its_trace_from_that_op_on(master, engine, name, first):
    """The hooks follow vLLM's residual adds, fused into the next norm, to the right names:
    one op's weights nudged change vLLM's own trace at that op and at no earlier point."""
    nudged_op_is_named(master[0], engine, name, first)


def test_one_row_of_vllms_fused_gate_up_is_named_at_up_and_nothing_before(master, engine):
    """vLLM's fused `gate_up_proj` with one row of its up half scaled (the master's up_proj row
    5 by 3, synced): --locate names layer 1's up projection, from vLLM's own trace, with the
    gate half and everything before it on the precision curve."""
    from parity.audit import locate as loc
    from parity.config import AuditSettings
    model, tok = master
    moved = type(model)(model.config)
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        moved.model.layers[1].mlp.up_proj.weight[5].mul_(3.0)
    seqs = [prompts_of(tok)[i] + [5, 9, 14, 3, 27, 8, 11, 40] for i in range(3)]
    a = AuditSettings(model="m", task="neg-length", engine="vllm", engine_dtype="bf16")
    try:
        engine.sync(moved)
        res = loc.locate(model, engine, a, seqs, "engine=vllm")
    finally:
        engine.sync(model)
    assert (res["named"]["point"], res["op"]) == ("layers.1.up", "matmul"), res["finding"]
    assert "from layer 1's up projection (matmul)" in res["finding"]


def test_a_vllm_trace_without_one_layers_hooks_says_those_points_and_claims_nothing(master,
                                                                                   engine):
    """vLLM's hooks at layer 1 removed (as a compiled layer, or a renamed module, would leave
    them silent): --locate lists every point they gave as not traced, and claims nothing
    there."""
    from parity.audit import locate as loc
    from parity.config import AuditSettings
    model, tok = master
    seqs = [[5, 9, 14, 3, 27, 8, 11, 40, 2, 19], [7, 7, 30, 12, 4]]
    next(engine.trace(seqs))   # the tracer installed
    tracer = engine._tracer
    for h in tracer.layer_handles[1]:
        h.remove()
    try:
        a = AuditSettings(model="m", task="neg-length", engine="vllm", engine_dtype="bf16")
        res = loc.locate(model, engine, a, seqs, "engine=vllm")
    finally:
        tracer.close()
        engine._tracer = None
    # layer 1's input norm also gives the stream after layer 0, its post-attention norm the
    # stream after attention's add; the rotary module is every layer's (vLLM shares it), so
    # q and k after RoPE stay traced
    silent = ["layers.0.output"] + [p for p in res["points"] if p.startswith("layers.1.")
                                    and p.rsplit(".", 1)[1] not in ("output", "q_rope", "k_rope")]
    assert res["missing"]["engine"] == silent and res["missing"]["decode"] == silent
    assert all(res["curves"]["engine"]["median"][res["points"].index(p)] is None
               for p in silent)
    assert f"{len(silent)} of {len(res['points'])} points not traced" in res["finding"] or \
        res["named"] is not None
    assert any(d.startswith("not traced (engine): layers.0.output") for d in res["details"])
    # with its hooks back, every point is traced again
    again = loc.locate(model, engine, a, seqs, "engine=vllm")
    assert not again["missing"]["engine"] and not again["missing"]["decode"]


def test_scoring_follows_the_master_across_optimizer_steps(master, engine):
    """vLLM loads the master at every scoring call (an optimizer may change the weights without
    a trace parity could read: parity/engines/vllm.py), so after a step it scores the stepped
    weights, and the same weights twice give the same scores."""
    model, tok = master
    moved = type(model)(model.config)
    moved.load_state_dict(model.state_dict())
    s = Sampling()
    r = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(7))
    mask = r.completion_mask
    loads = []
    load = engine._load
    engine._load = lambda weights: (loads.append(1), load(weights))
    try:
        first = engine.score(moved, r, s)
        again = engine.score(moved, r, s)
        assert len(loads) == 2 and torch.equal(first, again)
        opt = torch.optim.SGD(moved.parameters(), lr=1e-2)
        (-score(moved, r, s) * mask).sum().backward()
        opt.step()
        after = engine.score(moved, r, s)
        assert len(loads) == 3
        # vLLM scores the stepped weights, not the ones it held
        bf16 = HFEngine(moved, "bf16", tok.eos_token_id, tok.pad_token_id).score(moved, r, s)
        to_new = float(((after - bf16).abs() * mask).sum() / mask.sum())
        to_old = float(((first - bf16).abs() * mask).sum() / mask.sum())
        assert to_new < 0.05 and to_old > 4 * to_new, (to_new, to_old)
    finally:
        del engine._load
    # sampling goes back to the synced weights
    assert engine.generate(prompts_of(tok), 16, s,
                           torch.Generator().manual_seed(7)).completions() == r.completions()


def test_vllm_scores_with_the_raw_model_whatever_the_sampling(master, engine):
    """Why an engine-scored shadow with vLLM is refused at T != 1 or with top-p/top-k
    (parity/config/run.py): vLLM's prompt log-probs are the raw model's, not the processed
    distribution ℓ_μ was sampled from."""
    model, tok = master
    s = Sampling(0.7, 1.0, 0)
    r = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(4))
    scored = engine.score(model, r, s)
    raw = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id).score(model, r, Sampling())
    mask = r.completion_mask
    assert ((scored - r.engine_logprobs).abs() * mask).max() > 0.1
    assert ((scored - raw).abs() * mask).sum() / mask.sum() < 0.05


ARGS = ["--model", "text-xs", "--engine", "vllm", "--prompts-per-step", "2",
        "--samples-per-prompt", "4", "--max-new-tokens", "8", "--threads", "1", "--no-progress",
        "--lr", "1e-3", "--report-to", "none"]


def test_training_with_vllm_then_resume_equals_the_uninterrupted_run(tmp_path, text_model):
    full = train([*ARGS, "--steps", "4"], tmp_path / "full")
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    for m in full:
        assert m["mismatch/beta_abs_mean"] > 0 and m["mismatch/kl_exact_positions"] > 0
    assert any(m["sync/changed_frac"] > 0 for m in full[1:])
    train([*ARGS, "--steps", "2"], tmp_path / "part")
    assert resume(tmp_path / "part", 4) == full


def test_an_architecture_vllm_lacks_is_refused_in_one_line_before_the_run_starts(
        tmp_path, text_model):
    """vLLM would serve it through its Transformers fallback, which patches transformers'
    classes in the trainer's own process (the trainer's forward then fails mid-run)."""
    import shutil
    import subprocess
    import sys

    from cli_helpers import assert_user_error
    odd = tmp_path / "odd"
    shutil.copytree(text_model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["MarianForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--model", str(odd),
                        "--engine", "vllm", "--steps", "1", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert_user_error(p, "no implementation of MarianForCausalLM", "engine=hf")
    assert not (tmp_path / "run").exists()
