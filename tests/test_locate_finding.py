"""What `parity audit --locate` names, on known answers: a difference put at one sub-op (a Qwen3
k_norm, RoPE's angles in bf16, one row of the up projection, the decode step's attention) is
named there and nothing earlier; noise at the last bit everywhere, and fp32 on both sides, name
nothing; points an engine did not trace are said and claim nothing; at the logits a shift
common to the vocabulary moves neither |Δℓ| nor the KL."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from parity.audit import finding as fd
from parity.audit import locate as loc
from parity.config import AuditSettings
from parity.engines.hf import HFEngine
from parity.models import trace as tr
from test_locate import LAYERS, nudged, random_llama, same_kernels_engine, sequences, settings


@pytest.fixture(scope="module")
def master():
    return random_llama()


@pytest.fixture(scope="module")
def qwen3():
    """A random Qwen3 (q_norm and k_norm on every layer's heads), norms other than 1."""
    return random_llama(Qwen3Config, Qwen3ForCausalLM, head_dim=16)


def long_sequences() -> list[list[int]]:
    """Hundreds of positions, where angles in bf16 are off by a tenth of a radian."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 96, (n,), generator=g).tolist() for n in (500, 400)]


def named(res) -> tuple[str, str, str] | None:
    n = res["named"]
    return None if n is None else (n["point"], n["op"], n["pass"])


def test_every_point_of_the_trainers_trace_is_in_each_of_parity_engines_traces(qwen3):
    seq = sequences(1)[0]
    ref = tr.trace(qwen3, seq)
    eng = HFEngine(qwen3, "bf16", 1, 0)
    assert set(next(eng.trace([seq]))) == set(ref)
    decode = next(eng.trace_decode([seq]))
    assert set(decode) == set(ref) and all(decode[p].shape[0] == 1 for p in decode)
    assert all(decode[p].shape[1] == ref[p].shape[1] for p in ref)
    layer = [p.split(".", 2)[2] for p in tr.in_order(ref, LAYERS) if p.startswith("layers.1.")]
    assert layer[:9] == ["input_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope",
                         "attn_kernel"]


def test_a_nudged_k_norm_is_named_at_its_layer(qwen3):
    eng = same_kernels_engine(qwen3)
    with torch.no_grad():
        eng.model.model.layers[2].self_attn.k_norm.weight.mul_(1.05)
    res = loc.locate(qwen3, eng, settings(), sequences(), "engine=hf")
    assert named(res) == ("layers.2.k_norm", "norm", "prefill")
    assert "from layer 2's k_norm (norm)" in res["finding"]
    assert res["first_difference"] == "layers.2.k_norm"


def rope_angles_in_bf16(self, x, position_ids):
    """Llama's rotary embedding with its angles (inverse frequency times position) in bf16."""
    inv = self.inv_freq[None, :, None].to(torch.bfloat16).expand(position_ids.shape[0], -1, 1)
    freqs = (inv * position_ids[:, None, :].to(torch.bfloat16)).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1).float()
    return ((emb.cos() * self.attention_scaling).to(x.dtype),
            (emb.sin() * self.attention_scaling).to(x.dtype))


def test_rope_computed_in_bf16_is_named_at_q_after_rope(master):
    eng = same_kernels_engine(master)
    rope = eng.model.model.rotary_emb
    rope.forward = rope_angles_in_bf16.__get__(rope)
    res = loc.locate(master, eng, settings(), long_sequences(), "engine=hf")
    assert named(res) == ("layers.0.q_rope", "RoPE", "prefill")
    i = res["points"].index("layers.0.q_rope")
    assert res["curves"]["engine_vs_precision"]["max"][:i] == [0.0] * i


def test_one_row_of_the_up_projection_is_named_at_up(master):
    res = loc.locate(master, nudged(master, 1, "mlp.up_proj", factor=3.0, row=5), settings(),
                     sequences(), "engine=hf")
    assert named(res) == ("layers.1.up", "matmul", "prefill")


DECODE_NUDGED = "parity_test_decode_nudged"


def decode_nudged(module, query, key, value, attention_mask, parity_kv_len=None, **kw):
    """The trainer's attention (SDPA), its output scaled by 1.02 in decode steps only (one
    query against the KV cache)."""
    kw.pop("parity_scratch", None)
    out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    return (out * 1.02 if parity_kv_len is not None and query.shape[2] == 1 else out), w


AttentionInterface.register(DECODE_NUDGED, decode_nudged)


def test_a_decode_only_difference_is_named_in_decode_and_nothing_in_the_prefill(master):
    eng = same_kernels_engine(master)
    eng.model.set_attn_implementation(DECODE_NUDGED)
    res = loc.locate(master, eng, settings(), sequences(), "engine=hf")
    assert named(res) == ("layers.0.attn_kernel", "attention kernel", "decode")
    assert "matter in its decode steps from layer 0's attention kernel" in res["finding"]
    dvp = res["curves"]["decode_vs_prefill"]
    i = res["points"].index("layers.0.attn_kernel")
    assert dvp["max"][:i] == [0.0] * i and dvp["median"][i] > 0.01
    assert loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}})[0].startswith(
        "where the engine's kernels matter in decode steps: layer 0's attention kernel")


def last_bit_noise(share: float, seed: int):
    """A forward hook that moves `share` of a bf16 output's elements by one unit in the last
    place, up or down at random: kernels that round otherwise, everywhere."""
    g = torch.Generator().manual_seed(seed)

    def hook(mod, args, out):
        x = out[0] if isinstance(out, tuple) else out
        bits = x.view(torch.int16)
        hit = torch.rand(x.shape, generator=g) < share
        step = torch.where(torch.rand(x.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        moved = torch.where(hit & (x != 0), bits + step, bits).view(torch.bfloat16)
        return (moved, *out[1:]) if isinstance(out, tuple) else moved
    return hook


def test_noise_at_the_last_bit_over_every_layer_names_nothing_and_says_precision(master):
    eng = same_kernels_engine(master)
    for i, layer in enumerate(eng.model.model.layers):
        for mod in (layer.self_attn, layer.mlp, layer.input_layernorm):
            mod.register_forward_hook(last_bit_noise(0.25, i))
    res = loc.locate(master, eng, settings(), sequences(), "engine=hf")
    assert res["named"] is None and res["first_difference"] == "layers.0.input_norm"
    assert "the gap is precision" in res["finding"]
    line = loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}})
    assert line == [f"no op of the engine's rises above precision: {fd.PRECISION}"]


def test_fp32_on_both_sides_names_nothing_where_only_the_sums_order_differs(master):
    """parity's fp32 engine attends with its own kernel (parity/models/attention.py), the
    trainer with SDPA: they part in the last bits, far under the floor."""
    a = AuditSettings(model="m", task="neg-length", engine_dtype="fp32", trainer_dtype="fp32")
    res = loc.locate(master, HFEngine(master, "fp32", 1, 0), a, sequences(), "engine=hf")
    assert res["named"] is None and res["first_difference"] is not None
    assert "stays within 0.0001 of the fp32 trainer" in res["finding"]
    assert loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}}) == []


class Untraced:
    """An engine whose trace lacks some points (hooks that did not fire)."""

    def __init__(self, engine: HFEngine, lacks):
        self.engine, self.lacks = engine, lacks

    def trace(self, sequences):
        for t in self.engine.trace(sequences):
            yield {p: x for p, x in t.items() if not self.lacks(p)}

    def trace_decode(self, sequences):
        for t in self.engine.trace_decode(sequences):
            yield {p: x for p, x in t.items() if not self.lacks(p)}


def test_points_an_engine_did_not_trace_are_said_and_claim_nothing(master):
    eng = nudged(master, 1, "mlp.down_proj", factor=1.5)
    res = loc.locate(master, Untraced(eng, lambda p: p.startswith("layers.1.")), settings(),
                     sequences(), "engine=hf")
    lacked = [p for p in res["points"] if p.startswith("layers.1.")]
    assert res["missing"]["engine"] == lacked and not res["missing"]["precision"]
    i = res["points"].index("layers.1.mlp")
    assert res["curves"]["engine"]["median"][i] is None
    # the nudge shows again at layer 2, the first traced point after it
    assert named(res)[0] == "layers.2.input_norm"
    assert any(d.startswith("not traced (engine): layers.1.input_norm") for d in res["details"])
    res = loc.locate(master, Untraced(same_kernels_engine(master), lambda p: p != "embed"),
                     settings(), sequences(), "engine=hf")
    assert "(%d of %d points not traced, nothing claimed there)" % (
        len(res["points"]) - 1, len(res["points"])) in res["finding"]
    res = loc.locate(master, Untraced(same_kernels_engine(master), lambda p: True), settings(),
                     sequences(), "engine=hf")
    assert "held none of the trainer's points: nothing is claimed" in res["finding"]
    assert loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}}) == []


def test_at_the_logits_a_shift_common_to_the_vocabulary_moves_no_log_prob():
    """A relative error counts a shift of every logit; the sampled token's |Δℓ| and the KL, by
    hand, do not."""
    ref = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [0.0, 0.0, 0.0]])
    ids = [0, 1, 2]   # position t predicts ids[t + 1]
    located = loc.Located(["logits"])
    located.logits("shifted", {"logits": ref + 7.0}, {"logits": ref}, ids, 1)
    x = ref.clone()
    x[0, 1] += 1.0   # the first position's sampled token (ids[1]) up by one logit
    located.logits("moved", {"logits": x}, {"logits": ref}, ids, 1)
    got = located.logit_summary()
    assert got["shifted"]["abs_dlogp_max"] < 1e-12 and got["shifted"]["kl_mean"] < 1e-12
    assert loc.relative_errors({"logits": ref + 7.0}, {"logits": ref})["logits"].min() > 1
    p = torch.softmax(ref[0].double(), -1)
    q = torch.softmax(x[0].double(), -1)
    dl0 = abs(float(torch.log(q[1]) - torch.log(p[1])))
    assert got["moved"]["tokens"] == 2
    assert got["moved"]["abs_dlogp_mean"] == pytest.approx(dl0 / 2, rel=1e-12)
    assert got["moved"]["kl_mean"] == pytest.approx(float((p * (p / q).log()).sum()) / 2,
                                                    rel=1e-12)


def test_the_engines_copy_keeps_ropes_frequencies_as_a_model_loaded_in_bf16_does(tmp_path, master):
    """transformers loading a model in bf16 keeps RoPE's inverse frequencies in fp32; the
    engine's and the shadow's copies (`.to(bf16)` of the master) keep the same values."""
    from transformers import LlamaForCausalLM

    from parity.models.precision import low_precision_copy
    master.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    copy_ = low_precision_copy(master, "bf16")
    want = loaded.model.rotary_emb.inv_freq
    got = copy_.model.rotary_emb.inv_freq
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert copy_.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_a_bf16_engine_against_a_bf16_trainer_is_read_against_precision_not_the_floor(master):
    """The same dtype on both sides is not agreement: a bf16 trainer runs under autocast over
    fp32 weights, its engine on a bf16 copy, and they part by a bf16 rounding."""
    a = AuditSettings(model="m", task="neg-length", engine_dtype="bf16", trainer_dtype="bf16")
    res = loc.locate(master, HFEngine(master, "bf16", 1, 0), a, sequences(), "engine=hf")
    assert res["named"] is None and "the gap is precision" in res["finding"]
    assert "stays within" not in res["finding"]
    assert loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}}) == [
        f"no op of the engine's rises above precision: {fd.PRECISION}"]


def test_logits_that_overflowed_are_left_out_and_counted_every_figure_finite():
    """An fp16 forward's logits can overflow; a token no side gives mass to is -inf on both:
    the figures stay finite, the overflowed position is left out and said once."""
    ref = torch.tensor([[1.0, 2.0, float("-inf")], [0.5, -1.0, 3.0], [0.0, 1e4, -1e4]])
    x = ref.clone()
    x[1, 0] = float("inf")   # position 1 overflowed in the engine
    located = loc.Located(["logits"])
    located.logits("engine", {"logits": x}, {"logits": ref}, [0, 1, 0, 1], 1)
    got = located.logit_summary()["engine"]
    assert got["left_out"] == 1 and got["tokens"] == 2
    assert all(v is not None and torch.isfinite(torch.tensor(float(v)))
               for k, v in got.items())
    res = {"logits": {"engine": got}, "missing": {}, "first_difference": None}
    assert fd.details(res) == ["at the logits (engine): 1 positions whose logits are not "
                               "finite, left out"]
