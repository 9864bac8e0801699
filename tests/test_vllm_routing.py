"""vLLM's expert choices, read from its routers in this process (parity/engines/vllm_routing.py),
on the test-size mixture of experts: every fed position recorded in the rollout's layout, the
same experts the trainer's own router picks where the arithmetic is the same, and replay and
the routing figures through `parity train --engine vllm`."""

from __future__ import annotations

import pytest
import torch

from parity import metric_names as mn
from parity.engines import EngineSpec, make_engine
from parity.logprobs import Sampling
from parity.models import routing
from parity.models.forward import score
from parity.models.loading import load_policy
from vllm_helpers import TEXTS, train

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vllm_ready")]


@pytest.fixture(scope="module")
def master(moe_model):
    model, tok = load_policy(moe_model)
    return model.eval(), tok


def _engine(model, tok, moe_model, dtype):
    eng = make_engine("vllm", EngineSpec(model, str(moe_model), dtype, [tok.eos_token_id],
                                         tok.pad_token_id, 0, 64, 16))
    eng.sync(model)
    return eng


def _own(model, r) -> torch.Tensor:
    """The trainer's own routing of the rollout's tokens, [B, P + T, L, k]."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)
    with torch.no_grad(), routing.recording(model) as rec:
        model(input_ids=ids, attention_mask=mask.long())
    return rec.ids(ids.shape[0])


def test_vllm_records_every_fed_position_with_the_trainers_experts_in_fp32(master, moe_model):
    """fp32 vLLM against the fp32 trainer on the same tokens: the record names the experts of
    exactly the positions vLLM fed (each real prompt token, each sampled token but the last),
    none of the left padding, and they are the trainer's own at (nearly) every one, as are
    the log-probs; a second batch starts from a clean record."""
    model, tok = master
    eng = _engine(model, tok, moe_model, "fp32")
    try:
        prompts = [tok(t)["input_ids"] for t in TEXTS[:6]]
        for seed in (0, 1):
            r = eng.generate(prompts, 16, Sampling(), torch.Generator().manual_seed(seed))
            L, E, k = routing.shape(model)
            assert r.routed is not None and r.routed.dtype == torch.uint8
            P, T = r.prompt_ids.shape[1], r.completion_ids.shape[1]
            assert r.routed.shape == (len(prompts), P + T, L, k)
            fed = torch.cat([r.prompt_mask.bool(), r.completion_mask.bool()], 1)
            lengths = r.completion_mask.sum(1).long()
            fed[torch.arange(len(prompts)), P + lengths - 1] = False   # the last, never fed
            assert torch.equal(routing.known(r.routed, E).all(-1), fed)
            own = _own(model, r)
            differ = routing.decisions_differ(r.routed, own)[fed]
            assert differ.float().mean() <= 0.01, float(differ.float().mean())
            # and vLLM computes the trainer's model after the sync's reload (its CPU build
            # left a reloaded mixture of experts unpacked: 0.2 nats a token apart)
            mask = r.completion_mask
            gap = ((score(model, r, Sampling()) - r.engine_logprobs).abs() * mask).sum()
            assert gap / mask.sum() < 1e-4, float(gap / mask.sum())
    finally:
        eng.close()


def test_bf16_vllm_flips_routing_where_fp32_does_not(master, moe_model):
    """The same prompts through bf16 vLLM: some decisions differ from the fp32 trainer's, and
    every one of them where the router's top-k margin is small (a near tie, not a bug in the
    mapping: a misplaced column would flip decisions at any margin)."""
    model, tok = master
    eng = _engine(model, tok, moe_model, "bf16")
    try:
        prompts = [tok(t)["input_ids"] for t in TEXTS[:8]] * 2
        r = eng.generate(prompts, 24, Sampling(), torch.Generator().manual_seed(0))
    finally:
        eng.close()
    E = routing.shape(model)[1]
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)
    with torch.no_grad(), routing.recording(model) as rec:
        model(input_ids=ids, attention_mask=mask.long())
    own, margins = rec.ids(ids.shape[0]), rec.margins(ids.shape[0])
    known = routing.known(r.routed, E)
    differ = routing.decisions_differ(r.routed, own) & known
    assert differ.any()
    assert differ.float().sum() / known.float().sum() < 0.2
    assert margins[differ].max() < 0.1 < margins[known & ~differ].median()


def test_train_with_vllm_logs_the_routing_and_replays_it(moe_model, tmp_path):
    """`parity train --engine vllm` on a mixture of experts logs the routing figures, and
    `--routing-replay` routes the trainer as vLLM did: on the same first rollout (the same
    seed), the tokens whose routing flipped keep a smaller |β| than without replay."""
    args = ["--model", str(moe_model), "--engine", "vllm", "--steps", "1",
            "--prompts-per-step", "2", "--samples-per-prompt", "8", "--max-new-tokens", "24",
            "--no-progress"]
    plain = train(args, tmp_path / "plain")[0]
    replayed = train([*args, "--routing-replay"], tmp_path / "replayed")[0]
    for step in (plain, replayed):
        assert 0 < step[mn.ROUTING_FLIP_FRAC] < 0.5
    # the same seed samples the same first rollout, and the trainer's first MoE layer routes
    # the same hidden states with or without replay (deeper ones see what replay gave them)
    first = mn.ROUTING_FLIP_FRAC_LAYER.format(layer=0)
    assert plain[first] == replayed[first]
    assert plain[mn.REWARD_MEAN] == replayed[mn.REWARD_MEAN]
    # Which tokens flip, and by how much a flip moves them, is the CPU's bf16 kernels' doing
    # (and its thread count's): with replay the flipped tokens keep the others' gap; where the
    # flips had moved them past it, replay brings their gap down. One process here, 2 threads:
    # 0.023 without replay, 0.0010 with, against 0.0054-0.0061 unflipped; a test worker's thread
    # on an AVX2-only CPU: 0.0073 and 0.0075, its flips at the others' gap already.
    if plain[mn.ROUTING_TOKEN_FLIP_FRAC] > 0:
        assert replayed[mn.ROUTING_BETA_ABS_FLIPPED] < 2 * replayed[mn.ROUTING_BETA_ABS_UNFLIPPED]
        if plain[mn.ROUTING_BETA_ABS_FLIPPED] > 2 * plain[mn.ROUTING_BETA_ABS_UNFLIPPED]:
            assert replayed[mn.ROUTING_BETA_ABS_FLIPPED] < plain[mn.ROUTING_BETA_ABS_FLIPPED]


def test_locate_traces_vllms_routers_against_the_trainers(moe_model, tmp_path):
    """`--locate --engine vllm` on a mixture of experts: vLLM's forward traced at every layer,
    the routers' logits (`router`) and the MoE blocks' outputs included, against the trainer's
    own; in fp32 on both sides every point agrees to float rounding, and no router is named."""
    import json

    from cli_helpers import run_main
    out = tmp_path / "audit"
    p = run_main("audit", "--model", moe_model, "--engine", "vllm", "--engine-dtype", "fp32",
                 "--trainer-dtype", "fp32", "--samples", "8", "--max-new-tokens", "16",
                 "--locate", "--no-progress", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    layers = json.loads((out / "audit.json").read_text())["locate"]["layers"]
    engine = layers["curves"]["engine"]   # vLLM's prefill against the trainer's forward
    for j in (0, 1):
        for point in (f"layers.{j}.router", f"layers.{j}.mlp"):
            median = engine["median"][layers["points"].index(point)]
            assert median is not None and median < 1e-4, (point, median)
    assert (layers["named"] or {}).get("op") != "router"
