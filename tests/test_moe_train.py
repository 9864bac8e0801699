"""`parity train` on the test-size mixture of experts: the engine's routing is recorded, the
trainer's own routing compared with it and the figures logged under `routing/`; with
`--routing-replay` the trainer routes as the engine did, so the tokens whose routing flipped
lose the gap the flips gave them; replay is refused in one line where nothing can be replayed."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_user_error, run_main
from parity import metric_names as mn
from parity.engines import engines_that
from parity.engines.abilities import EngineCan, EngineNeeds, refuse_what_it_cannot
from parity.errors import ParityError

pytestmark = pytest.mark.e2e

RUN = ("--task", "neg-length", "--steps", "2", "--prompts-per-step", "4",
       "--samples-per-prompt", "4", "--max-new-tokens", "24", "--no-progress")


def train(model, out, *extra):
    p = run_main("train", "--model", model, *RUN, "--out", out, *extra)
    assert p.returncode == 0, p.stderr
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_routing_is_measured_and_replay_closes_the_flipped_tokens_gap(moe_model, tmp_path):
    free = train(moe_model, tmp_path / "free")
    replayed = train(moe_model, tmp_path / "replayed", "--routing-replay")
    for step in free + replayed:
        assert 0 <= step[mn.ROUTING_FLIP_FRAC] <= 1
        assert 0 <= step[mn.ROUTING_TOKEN_FLIP_FRAC] <= 1
        layers = [step[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j)] for j in (0, 1)]
        assert step[mn.ROUTING_FLIP_FRAC] == pytest.approx(sum(layers) / 2)
        assert step[mn.ROUTING_MARGIN_MEAN] > 0
    a, b = free[0], replayed[0]
    # the same seed samples the same first rollout; the trainer's own choice at the first MoE
    # layer is made on the same hidden states with or without replay (deeper layers' on the
    # hidden states replay gave them)
    first = mn.ROUTING_FLIP_FRAC_LAYER.format(layer=0)
    assert a[first] == b[first]
    assert a[mn.REWARD_MEAN] == b[mn.REWARD_MEAN]
    if a[mn.ROUTING_TOKEN_FLIP_FRAC] > 0:
        assert b[mn.ROUTING_BETA_ABS_FLIPPED] < a[mn.ROUTING_BETA_ABS_FLIPPED]
        # an unflipped token routes the same either way: its gap does not move
        assert b[mn.ROUTING_BETA_ABS_UNFLIPPED] == pytest.approx(a[mn.ROUTING_BETA_ABS_UNFLIPPED],
                                                                 rel=0.05)


def test_replay_is_refused_where_nothing_can_be_replayed(moe_model, text_model, tmp_path):
    assert_user_error(run_main("train", "--model", text_model, "--routing-replay", "--steps", "1",
                               "--out", tmp_path / "dense"), "--routing-replay",
                      "no mixture-of-experts")
    assert not (tmp_path / "dense").exists()
    # an engine that returns no routing (both of parity's return it) is refused by its entry
    with pytest.raises(ParityError, match="engine=other returns no routing to replay: "
                                          "--routing-replay needs engine=hf or engine=vllm"):
        refuse_what_it_cannot("other", EngineCan(False, False, False), EngineNeeds(routing=True),
                              engines_that)


def test_an_audit_of_a_mixture_of_experts_reports_its_routing(moe_model, tmp_path):
    out = tmp_path / "audit"
    p = run_main("audit", "--model", moe_model, "--samples", "16", "--max-new-tokens", "24",
                 "--locate", "--no-progress", "--out", out)
    assert p.returncode == 0, p.stderr
    m = json.loads((out / "audit.json").read_text())["metrics"]
    layers = [m[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j)] for j in (0, 1)]
    assert m[mn.ROUTING_FLIP_FRAC] == pytest.approx(sum(layers) / 2)
    assert "routing: " in p.stdout and "of router decisions flipped" in p.stdout
    page = (out / "report.html").read_text()
    assert "Routing (a mixture of experts)" in page and (out / "routing.png").is_file()
    located = json.loads((out / "audit.json").read_text())["locate"]["layers"]
    assert set(located["router_flips"]) == {"0", "1"}   # JSON's keys
    assert set(located["router_flips_sampled"]) == {"0", "1"}
    assert [located["router_flips_sampled"][j] for j in "01"] == pytest.approx(layers)
    assert "layers.0.router" in located["points"] and "layers.1.router" in located["points"]


def test_lora_adapts_the_experts_and_the_engine_serves_the_merged_weights(moe_model, tmp_path):
    """peft adapts a mixture of experts' 3-D expert weights and its routers in place (its
    ParamWrapper); the engine's merged copy takes each of them, summed in fp32."""
    rows = train(moe_model, tmp_path / "lora", "--lora-rank", "4", "--max-new-tokens", "48")
    assert rows[-1][mn.SYNC_CHANGED_FRAC] > 0.1    # the update reached the engine's weights
    assert rows[0][mn.KERNEL_GAP_ABS_MEAN] < 1e-4  # the shadow sees the engine's merged weights
    assert mn.ROUTING_FLIP_FRAC in rows[0]


def test_an_audit_file_with_routed_experts_is_compared_with_the_trainers_routing(moe_model,
                                                                                tmp_path):
    """An audit input file's `routed_experts` column (as vLLM returns it: [tokens, layers,
    top-k] over the prompt and completion, the last token left out): the trainer's own fp32
    routing given back flips (nearly) nothing; the same with layer 1's experts shifted by one
    flips every decision of layer 1 and none of layer 0. A record of the wrong shape is refused
    in one line naming its row and column."""
    import torch

    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models import routing
    from parity.models.loading import load_policy
    model, tok = load_policy(moe_model)
    model.eval()
    prompts = [tok(t)["input_ids"] for t in ("the cat", "a man went", "she said", "on a")]
    r = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id).generate(
        prompts, 12, Sampling(), torch.Generator().manual_seed(0))
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    with torch.no_grad(), routing.recording(model) as rec:
        model(input_ids=ids, attention_mask=torch.cat([r.prompt_mask, r.completion_mask],
                                                      1).long())
    own, P, E = rec.ids(len(prompts)), r.prompt_ids.shape[1], routing.shape(model)[1]

    def audit(name, shift_layer=None):
        rows = []
        for i, p in enumerate(prompts):
            c = r.completions()[i]
            rec_i = own[i, P - len(p):P + len(c) - 1].clone()
            if shift_layer is not None:
                rec_i[:, shift_layer] = (rec_i[:, shift_layer] + 1) % E
            rows.append({"prompt_token_ids": p, "completion_token_ids": c,
                         "engine_logprobs": r.engine_logprobs[i, :len(c)].tolist(),
                         "routed_experts": rec_i.tolist()})
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in rows))
        return run_main("audit", "--model", moe_model, "--rollouts", f, "--no-progress",
                        "--out", tmp_path / name), f

    p, _ = audit("own")
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "own" / "audit.json").read_text())["metrics"]
    assert m[mn.ROUTING_FLIP_FRAC] < 0.01
    p, f = audit("shifted", shift_layer=1)
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "shifted" / "audit.json").read_text())["metrics"]
    assert m[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=1)] == 1.0
    assert m[mn.ROUTING_FLIP_FRAC_LAYER.format(layer=0)] < 0.01
    rows = [json.loads(x) for x in f.read_text().splitlines()]
    rows[2]["routed_experts"][0] = rows[2]["routed_experts"][0][:1]   # one layer, not two
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert_user_error(run_main("audit", "--model", moe_model, "--rollouts", f, "--out",
                               tmp_path / "bad"), "row 2, column 'routed_experts'",
                      "token 0 must hold 2 layers of 2 expert ids in 0..7")
    assert not (tmp_path / "bad").exists()
