"""The `vllm` engine on a CUDA device: the code path the CPU build runs in tests/test_vllm_real.py,
with the master weights, the engine-precision copy and vLLM on the GPU. Sampling with processed
log-probs, the weight sync, the engine-scored shadow, training every recipe, and a resume that
equals the uninterrupted run. Skipped where torch sees no CUDA or vLLM is absent (`pytest -m gpu`
on a GPU machine with vLLM's CUDA build runs them; docs/vllm.md)."""

from __future__ import annotations

import pytest
import torch

from parity.config import RECIPES
from parity.engines import EngineSpec, make_engine
from parity.engines.hf import HFEngine
from parity.logprobs import Sampling
from parity.models.loading import load_policy
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

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.usefixtures("vllm_ready")]

@pytest.fixture(scope="module")
def master(text_model):
    model, tok = load_policy(text_model)
    return model.to("cuda").eval(), tok


@pytest.fixture(scope="module")
def engine(master, text_model):
    yield from vllm_engine(*master, text_model)


def mean_gap(a, b, mask):
    return float(((a - b).abs() * mask).sum() / mask.sum())


def test_vllm_samples_on_the_gpu_with_processed_logprobs(master, engine):
    """At T = 0.7, top-k 20: ℓ_μ is the log-prob under the tempered, truncated distribution,
    on the trainer's device, within the bf16 gap of parity's own bf16 forward."""
    model, tok = master
    assert engine.device.type == "cuda"
    s = Sampling(0.7, 1.0, 20)
    r = engine.generate(prompts_of(tok), 24, s, torch.Generator().manual_seed(1))
    assert r.engine_logprobs.device.type == "cuda"
    mask = r.completion_mask
    assert mask.sum() > 40 and (r.engine_logprobs[mask == 0] == 0).all()
    hf = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id)
    processed, raw = hf.score(model, r, s), hf.score(model, r, Sampling())
    gap, off = mean_gap(processed, r.engine_logprobs, mask), mean_gap(raw, r.engine_logprobs, mask)
    print(f"cuda: |parity bf16 - vLLM bf16| {gap:.2e} per token; raw model off by {off:.2e}")
    assert gap < 0.05 and off > 5 * gap


def test_vllm_on_the_gpu_draws_the_same_rows_in_any_piece(master, engine):
    model, tok = master
    ps = prompts_of(tok) * 2
    a = engine.generate(ps, 16, Sampling(), torch.Generator().manual_seed(5))
    b = engine.generate(ps, 16, Sampling(), torch.Generator().manual_seed(5), max_batch=5)
    assert a.completions() == b.completions()
    assert a.completions()[:8] != a.completions()[8:]


def after_a_sync(engine, model, tok) -> tuple[float, float]:
    """Sync `engine` to moved weights, sample, and say how far its ℓ_μ is from the new weights'
    bf16 scores and from the old ones'."""
    moved, s = moved_copy(model), Sampling()
    assert 0.1 < engine.sync(moved) <= 1.0
    after = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(3))
    new = HFEngine(moved, "bf16", tok.eos_token_id, tok.pad_token_id).score(moved, after, s)
    old = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id).score(model, after, s)
    return (mean_gap(new, after.engine_logprobs, after.completion_mask),
            mean_gap(old, after.engine_logprobs, after.completion_mask))


def test_sync_on_the_gpu_changes_what_vllm_samples_from(master, engine):
    model, tok = master
    try:
        to_new, to_old = after_a_sync(engine, model, tok)
        print(f"cuda: after a sync, vLLM is {to_new:.2e} from the new weights, "
              f"{to_old:.2e} from the old")
        assert to_new < 0.05 and to_old > 4 * to_new
    finally:
        engine.sync(model)


def test_the_engine_scored_shadow_on_the_gpu(master, engine):
    """How far vLLM's scoring of a finished sequence is from what it recorded while decoding.
    On the CPU build the two are equal (tests/test_vllm_real.py); a GPU's batched prefill and
    decode kernels may differ, and that difference is what a scored shadow would carry."""
    model, tok = master
    r = engine.generate(prompts_of(tok), 16, Sampling(), torch.Generator().manual_seed(4))
    scored = engine.score(model, r, Sampling())
    mask = r.completion_mask
    hf = HFEngine(model, "bf16", tok.eos_token_id, tok.pad_token_id).score(model, r, Sampling())
    scored_gap, trainer_gap = (mean_gap(scored, r.engine_logprobs, mask),
                               mean_gap(hf, r.engine_logprobs, mask))
    print(f"cuda: vLLM scored vs decoded {scored_gap:.2e} per token "
          f"(max {float(((scored - r.engine_logprobs).abs() * mask).max()):.2e}); "
          f"parity's bf16 forward vs decoded {trainer_gap:.2e}")
    assert scored_gap < trainer_gap
    again = engine.generate(prompts_of(tok), 16, Sampling(), torch.Generator().manual_seed(4))
    assert again.completions() == r.completions()


def test_cuda_graphs_sample_as_eager_and_see_every_sync(master, engine, text_model):
    """`vllm_cuda_graphs`: decode steps replay graphs captured at start. They draw the rows eager
    vLLM draws, at its log-probs, and a weight sync reaches them (vLLM copies new weights into
    the captured tensors): after one, they sample from the new weights, not the old. Eager or
    replayed, the exact KL's rows are vLLM's own distribution, bit for bit."""
    model, tok = master
    graphs = make_engine("vllm", EngineSpec(model, str(text_model), "bf16", [tok.eos_token_id],
                                            tok.pad_token_id, 0, 64, 16, cuda_graphs=True))
    try:
        graphs.sync(model)
        s = Sampling()
        eager = engine.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(7))
        replay = graphs.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(7))
        same = sum(a == b for a, b in zip(eager.completions(), replay.completions()))
        print(f"cuda graphs: {same} of {len(eager.completions())} rows as eager vLLM drew them")
        assert same >= len(eager.completions()) // 2
        to_new, to_old = after_a_sync(graphs, model, tok)
        print(f"cuda graphs: after a sync, {to_new:.2e} from the new weights, {to_old:.2e} "
              f"from the old")
        assert to_new < 0.05 and to_old > 4 * to_new
        graphs.sync(model)
        # the exact KL's rows, read from the sampler, as vLLM returns them as Python objects
        for eng in (engine, graphs):
            r = eng.generate(prompts_of(tok), 16, s, torch.Generator().manual_seed(8),
                             record_rows=[2])
            tokens, ref = whole_distribution(eng, prompts_of(tok)[2], s, row_seed(8, 2, 8), 16,
                                             tok.eos_token_id)
            n = int(r.completion_mask[2].sum())
            assert tokens == r.completions()[2]
            assert torch.equal(r.dists[0, :n].cpu(), ref)
    finally:
        graphs.close()


ARGS = ["--model", "text-xs", "--engine", "vllm", "--device", "cuda", "--prompts-per-step", "2",
        "--samples-per-prompt", "4", "--max-new-tokens", "8", "--no-progress", "--lr", "1e-3",
        "--report-to", "none"]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_trains_with_vllm_on_cuda(recipe, tmp_path, text_model):
    rows = train([*ARGS, "--recipe", recipe, "--steps", "2"], tmp_path / recipe)
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["mismatch/beta_abs_mean"] >= 0 for m in rows)
    assert rows[1]["sync/changed_frac"] > 0


def test_a_vllm_run_on_cuda_resumes_as_one_run(tmp_path, text_model):
    full = train([*ARGS, "--steps", "4"], tmp_path / "full")
    train([*ARGS, "--steps", "2"], tmp_path / "part")
    resumed = resume(tmp_path / "part", 4)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    # Sampling is seeded per row, so the tokens are the same; the GPU's reductions need not
    # be bitwise repeatable, so the numbers are compared to a tolerance.
    for a, b in zip(full, resumed):
        assert a["completion/len_mean"] == b["completion/len_mean"], a["step"]
        for k, v in a.items():
            if isinstance(v, float):
                assert v == pytest.approx(b[k], rel=1e-3, abs=1e-5), (a["step"], k)


def test_vllms_trace_on_the_gpu_is_its_own_forward(master, engine):
    """`parity audit --locate` on vLLM's CUDA build: its prefill runs eagerly (CUDA graphs are
    decode-only), so the hooks see every op; the traced logits are those vLLM scores with."""
    trace_is_vllms_own(*master, engine)


@pytest.mark.parametrize("name,first", NUDGES)
def test_a_nudged_op_in_vllm_on_the_gpu_is_named(master, engine, name, first):
    nudged_op_is_named(master[0], engine, name, first)
