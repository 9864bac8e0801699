"""A mixture of experts' routing, recorded, compared and replayed (parity/models/routing.py,
parity/runs/routing_gap.py), on small random models of the four transformers MoE families:
replaying a router's own choice is its own forward bit for bit; a model against itself flips
nothing; a nudged router flips at its own layer and none before it; replay routes every token
as the record says and closes the gap the flips opened; R3's gate weights and their gradient
against float64; the figures against a hand-computed batch."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import transformers as tf

from parity import metric_names as mn
from parity.engines.hf import HFEngine
from parity.logprobs import Rollout, Sampling
from parity.models import routing
from parity.models.forward import pieces, score_full, score_pieces
from parity.runs import routing_gap

BODY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, intermediate_size=64)
FAMILIES = {
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**BODY, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=16, norm_topk_prob=True,
                                           head_dim=8),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**BODY, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=16,
                                           shared_expert_intermediate_size=16),
    "mixtral": lambda: tf.MixtralConfig(**BODY, num_local_experts=6, num_experts_per_tok=2),
    "olmoe": lambda: tf.OlmoeConfig(**BODY, num_experts=6, num_experts_per_tok=2),
}


def model(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = tf.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():   # random routers far from uniform, so ties are rare but exist
        for r in routing.routers(m):
            r.weight.normal_(0, 0.05)
    return m


def ids(batch: int = 4, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def own_routing(m: torch.nn.Module, x: torch.Tensor, replay: torch.Tensor | None = None):
    with torch.no_grad(), routing.recording(m) as rec, routing.replaying(m, replay):
        logits = m(x).logits
    return logits, rec.ids(x.shape[0]), rec.margins(x.shape[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_a_routers_own_choice_is_its_own_forward_bit_for_bit(family):
    m = model(family)
    assert len(routing.routers(m)) == 3 and routing.shape(m) == (3, 6, 2)
    x = ids()
    plain = m(x).logits
    logits, own, _ = own_routing(m, x)
    assert torch.equal(logits, plain)
    replayed, again, _ = own_routing(m, x, own)
    assert torch.equal(replayed, plain) and torch.equal(again, own)


def test_a_dense_model_has_no_routers_and_replay_changes_nothing():
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(**BODY)).eval()
    assert not routing.is_moe(m)
    with routing.recording(m) as rec, routing.replaying(m, None):
        m(ids())
    assert rec.layers == []


def test_a_model_against_itself_and_its_copy_flips_nothing():
    m = model()
    x = ids()
    _, a, _ = own_routing(m, x)
    _, b, _ = own_routing(copy.deepcopy(m), x)
    assert not routing.decisions_differ(a, b).any()


def nudged(m: torch.nn.Module, layer: int, flips) -> torch.nn.Module:
    """A copy whose router at `layer` is nudged by the smallest of a ladder of amounts (from
    1e-6: near ties flip first) for which `flips(copy)` holds."""
    for scale in (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3):
        e = copy.deepcopy(m)
        with torch.no_grad():
            w = routing.routers(e)[layer].weight
            w.add_(scale * torch.randn(w.shape, generator=torch.Generator().manual_seed(2)))
        if flips(e):
            return e
    raise AssertionError("no nudge up to 1e-3 flipped a decision")


def flips_on(m: torch.nn.Module, x: torch.Tensor, layer: int):
    _, own, _ = own_routing(m, x)
    return lambda e: bool(routing.decisions_differ(own, own_routing(e, x)[1])[..., layer].any())


@pytest.mark.parametrize("layer", [1, 2])
def test_a_nudged_router_flips_at_its_layer_and_at_none_before_it(layer):
    m = model()
    x = ids(8, 60)
    e = nudged(m, layer, flips_on(m, x, layer))
    _, own, _ = own_routing(m, x)
    _, theirs, margins = own_routing(e, x)
    flips = routing.decisions_differ(own, theirs)
    assert flips[..., layer].any()
    assert not flips[..., :layer].any()
    # the flips are near ties: their margin is far below the typical one
    assert margins[flips[..., layer], layer].max() < 0.1 * margins[..., layer].median()


def engine_rollout(e: torch.nn.Module, prompts: list[list[int]], steps: int = 16) -> Rollout:
    eng = HFEngine(e, "fp32", 0, 1)
    return eng.generate(prompts, steps, Sampling(), torch.Generator().manual_seed(3))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(2, 96, (n,), generator=g).tolist() for n in (7, 12, 3, 20, 9, 15, 5, 11)]


def test_the_engine_records_every_fed_position_and_pieces_record_the_same():
    m = model()
    r = engine_rollout(m, prompts())
    B, P, T = r.completion_ids.shape[0], r.prompt_ids.shape[1], r.completion_ids.shape[1]
    assert r.routed.shape == (B, P + T, 3, 2) and r.routed.dtype == torch.uint8
    known = routing.known(r.routed, 6).all(-1)
    assert known[:, :P + T - 1].all() and not known[:, P + T - 1].any()   # the last: never fed
    # the trainer's forward on the same tokens routes them as the fp32 engine did
    with torch.no_grad(), routing.recording(m) as rec:
        score_full(m, r, Sampling())
    counted, flips = routing_gap.flipped(r.routed, rec.ids(B), r.prompt_mask, r.completion_mask, 6)
    assert counted.sum() > 0 and not flips.any()
    eng = HFEngine(m, "fp32", 0, 1)
    parts = eng.generate(prompts(), 16, Sampling(), torch.Generator().manual_seed(3), max_batch=4)
    assert torch.equal(parts.routed, r.routed)


def test_replay_routes_every_token_as_the_engine_did_and_closes_the_gap_the_flips_opened():
    m = model()
    ps = prompts()

    def trainer_flips(e: torch.nn.Module) -> torch.Tensor:
        r = engine_rollout(e, ps, 24)
        with torch.no_grad(), routing.recording(m) as rec:
            score_full(m, dataclasses.replace(r, routed=None), Sampling())
        return routing_gap.flipped(r.routed, rec.ids(r.completion_ids.shape[0]), r.prompt_mask,
                                   r.completion_mask, 6)[1]

    e = nudged(m, 1, lambda e: bool(trainer_flips(e).any()))
    r = engine_rollout(e, ps, 24)
    mask = r.completion_mask > 0
    with torch.no_grad():
        free = score_full(m, dataclasses.replace(r, routed=None), Sampling()).logp
    with torch.no_grad():
        replayed = score_full(m, r, Sampling()).logp   # r carries its routing: replayed
        applied = _applied(m, r)
    known = routing.known(r.routed, 6)
    assert torch.equal(applied[known.all(-1)], r.routed.long()[known.all(-1)])
    gap_free = (free - r.engine_logprobs)[mask].abs().max()
    gap_replayed = (replayed - r.engine_logprobs)[mask].abs().max()
    # what is left is the nudge itself in the gate weights: far below the flips' gap
    assert gap_replayed < 1e-4 < gap_free
    # pieces (micro-batches, trimmed) replay the same columns
    split = score_pieces(m, r, Sampling(), pieces(r, rows=2)).logp
    assert torch.allclose(split[mask], replayed[mask], atol=1e-5)


def _applied(m: torch.nn.Module, r: Rollout) -> torch.Tensor:
    """The experts each router handed its experts module in a replayed forward."""
    got = []
    hooks = [blk.experts.register_forward_pre_hook(lambda mod, a: got.append(a[1]))
             for blk in (layer.mlp for layer in m.model.layers)]
    try:
        score_full(m, r, Sampling())
    finally:
        for h in hooks:
            h.remove()
    B = r.completion_ids.shape[0]
    return torch.stack([g.reshape(B, -1, g.shape[-1]) for g in got], dim=2).long()


@pytest.mark.parametrize("normalise", [True, False])
def test_gate_weights_and_their_gradient_against_float64(normalise):
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(50, 8, generator=g)).requires_grad_()
    chosen = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(50)])
    upstream = torch.randn(50, 2, generator=g)
    w = routing.gate_weights(logits, chosen, normalise)
    (w * upstream).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    p = ref_logits.exp() / ref_logits.exp().sum(-1, keepdim=True)
    ref = p.gather(-1, chosen)
    ref = ref / ref.sum(-1, keepdim=True) if normalise else ref
    (ref * upstream.double()).sum().backward()
    assert torch.allclose(w.double(), ref, rtol=1e-6, atol=1e-7)
    # renormalised, the unchosen experts' gradient is 0 exactly; fp32 leaves ~1e-8 of it
    assert torch.allclose(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert (logits.grad != 0).any(-1).all()   # the router keeps a gradient under replay


def test_the_figures_of_a_hand_made_batch():
    # one row, prompt of 2 (one padding), 3 completion tokens; 2 layers, top-1 of 4 experts
    eng = torch.tensor([[[[0], [1]], [[2], [3]], [[1], [1]], [[0], [2]], [[255], [255]]]],
                       dtype=torch.uint8)
    own = eng.clone()
    own[0, 1, 0, 0] = 3     # the last prompt token flips at layer 0: predicts completion token 0
    own[0, 3, 1, 0] = 0     # completion token 1 flips at layer 1: predicts completion token 2
    own[0, 0, 0, 0] = 3     # padding: not counted
    margins = torch.tensor([[[9.0, 9], [0.5, 4], [2, 2], [3, 0.25], [0, 0]]])
    pm, cm = torch.tensor([[0, 1]]), torch.tensor([[1.0, 1, 1]])
    beta = torch.tensor([[0.4, -0.1, 0.2]])
    phantom = torch.tensor([[True, True, False]])
    lp_mu = torch.tensor([[-1.0, -2, -3]])
    lp_pi = lp_mu + torch.tensor([[0.5, 0.0, -0.5]])
    f = routing_gap.figures(eng, own, margins, pm, cm, 4, beta, phantom, lp_pi, lp_mu)
    # counted positions: 1 (prompt), 2, 3 (completions 0, 1); 4 is unknown; 2 layers each
    assert f[mn.ROUTING_FLIP_FRAC] == pytest.approx(2 / 6)
    assert f[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=0)] == pytest.approx(1 / 3)
    assert f[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=1)] == pytest.approx(1 / 3)
    assert f[mn.ROUTING_MARGIN_AT_FLIPS] == pytest.approx((0.5 + 0.25) / 2)
    assert f[mn.ROUTING_MARGIN_MEAN] == pytest.approx((0.5 + 4 + 2 + 2 + 3 + 0.25) / 6)
    # tokens 0 and 2 flipped (predicted at positions 1 and 3), token 1 did not
    assert f[mn.ROUTING_TOKEN_FLIP_FRAC] == pytest.approx(2 / 3)
    assert f[mn.ROUTING_BETA_ABS_FLIPPED] == pytest.approx(0.3)
    assert f[mn.ROUTING_BETA_ABS_UNFLIPPED] == pytest.approx(0.1)
    assert f[mn.ROUTING_PHANTOM_FLIPPED_SHARE] == pytest.approx(0.5)
    assert f[mn.ROUTING_KL_K3_FLIPPED_SHARE] == pytest.approx(1.0)   # token 1's Δ is 0


def test_a_record_that_does_not_fit_the_forward_is_refused():
    m = model()
    _, own, _ = own_routing(m, ids(2, 10))
    with pytest.raises(ValueError, match="routing replay: layer 0 routes"):
        own_routing(m, ids(2, 12), own)


def test_locate_names_the_nudged_router_ahead_of_any_kernel_and_a_twin_names_none():
    from parity.audit import locate as loc
    from parity.config import AuditSettings
    m = model()
    seqs = [s + [5, 6, 7] for s in prompts()]
    a = AuditSettings(model="m", task="neg-length", engine_dtype="fp32", trainer_dtype="fp32")
    twin = HFEngine(m, "fp32", 0, 1)
    twin.model.set_attn_implementation(m.config._attn_implementation)
    same = loc.locate(m, twin, a, seqs, "engine=hf")
    assert same["named"] is None and set(same["router_flips"].values()) == {0.0}
    checks = [flips_on(m, torch.tensor([s]), 1) for s in seqs]   # each sequence on its own
    e = nudged(m, 1, lambda e: any(c(e) for c in checks))
    eng = HFEngine(e, "fp32", 0, 1)
    eng.model.set_attn_implementation(m.config._attn_implementation)
    res = loc.locate(m, eng, a, seqs, "engine=hf")
    assert res["router_flips"][0] == 0 and res["router_flips"][1] > 0
    assert (res["named"]["point"], res["named"]["op"]) == ("layers.1.router", "router")
    assert "layer 1's router" in res["finding"] and "--routing-replay" in fd_advice(res)


def fd_advice(res) -> str:
    from parity.audit import finding as fd
    return fd.advice(res)


def test_the_figures_leave_out_what_every_other_figure_leaves_out():
    # the hand-made batch above, with ℓ_μ of the flipped token 2 NaN, and a gap of 100 and a
    # log-prob of -1e4 on the others: every figure finite, token 2 not counted
    eng = torch.tensor([[[[0], [1]], [[2], [3]], [[1], [1]], [[0], [2]], [[255], [255]]]],
                       dtype=torch.uint8)
    own = eng.clone()
    own[0, 1, 0, 0] = 3
    own[0, 3, 1, 0] = 0
    margins = torch.ones(1, 5, 2)
    pm, cm = torch.tensor([[0, 1]]), torch.tensor([[1.0, 1, 1]])
    lp_mu = torch.tensor([[-1e4, -2.0, float("nan")]])
    lp_pi = torch.tensor([[-1e4 + 100, -2.0, -3.0]])
    f = routing_gap.figures(eng, own, margins, pm, cm, 4, torch.tensor([[100.0, 0, 5]]),
                            torch.tensor([[True, False, True]]), lp_pi, lp_mu)
    assert all(math.isfinite(v) for v in f.values())
    assert f[mn.ROUTING_TOKEN_FLIP_FRAC] == pytest.approx(1 / 2)   # tokens 0 and 1 counted
    assert f[mn.ROUTING_BETA_ABS_FLIPPED] == pytest.approx(100.0)
    assert f[mn.ROUTING_KL_K3_FLIPPED_SHARE] == pytest.approx(1.0)


def test_off_takes_parity_out_of_the_routers_and_puts_it_back():
    """Inside `routing.off` no hook of parity's runs (nothing recorded, the same forward), a
    hook of someone else's stays, and parity's is back after."""
    m, x = model(), ids()
    seen = []
    first = routing.routers(m)[0]
    first.register_forward_hook(lambda mod, a, out: seen.append(1))
    with torch.no_grad():
        want = m(x).logits
        with routing.off(m):
            assert not routing.is_moe(m)
            with routing.recording(m) as rec:
                got = m(x).logits
            assert rec.layers == []
            assert not any(h is routing._route for h in first._forward_hooks.values())
        assert torch.equal(got, want) and len(seen) == 2
        with routing.recording(m) as rec:
            m(x)
    assert len(rec.layers) == len(routing.routers(m)) and len(rec.layers[0]) == 1
