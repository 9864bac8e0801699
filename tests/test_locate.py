"""`parity audit --locate`: the trainer against itself and the gap located layer by layer, on
known answers (a model against itself, a nudged layer, a norm in the other dtype) and against a
float64 recomputation; then end to end through the command line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cli_helpers import run_main
from parity.audit import finding as fd
from parity.audit import locate as loc
from parity.config import AuditSettings
from parity.diagnostics import Shadow
from parity.engines import ENGINES, EngineCan, EngineNeeds, engines_that
from parity.engines.abilities import refuse_what_it_cannot
from parity.engines.hf import HFEngine
from parity.errors import ParityError
from parity.logprobs import Rollout, Sampling
from parity.models import trace as tr
from parity.models.forward import score_full, score_right_padded

LAYERS = 4


@pytest.fixture(scope="module")
def master():
    return random_llama()


def random_llama(config=LlamaConfig, model=LlamaForCausalLM, **kw):
    """A random Llama (or another family's `model` of its `config`) whose norms have weights
    other than 1 (so the order of a norm's casts shows), in fp32 with torch's SDPA attention,
    as the trainer loads a model."""
    torch.manual_seed(0)
    cfg = config(vocab_size=96, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
                 tie_word_embeddings=False, attn_implementation="sdpa", **kw)
    model = model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def settings(**kw) -> AuditSettings:
    return AuditSettings(model="m", task="neg-length", engine_dtype="bf16", **kw)


def sequences(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 96, (int(L),), generator=g).tolist() for L in (9, 17, 12)[:n]]


def same_kernels_engine(master) -> HFEngine:
    """parity's bf16 engine with the trainer's own attention: the very forward the precision
    curve runs."""
    eng = HFEngine(master, "bf16", 1, 0)
    eng.model.set_attn_implementation(master.config._attn_implementation)
    return eng


def test_a_model_against_itself_is_zero_at_every_point_and_names_no_op(master):
    res = loc.locate(master, same_kernels_engine(master), settings(), sequences(), "engine=hf")
    points = res["points"]
    # every sub-op a Llama layer has, in forward order; none it has not (q_norm is Qwen3's)
    layer0 = [p.split(".", 2)[2] for p in points if p.startswith("layers.0.")]
    assert layer0 == ["input_norm", "q", "k", "v", "q_rope", "k_rope", "attn_kernel",
                      "attention", "attention_add", "post_norm", "gate", "up", "act", "mlp",
                      "output"]
    assert points == tr.in_order(points, LAYERS) and len(points) == 3 + 15 * LAYERS
    same = res["curves"]["engine_vs_precision"]
    assert same["median"] == [0.0] * len(points) and same["max"] == [0.0] * len(points)
    assert res["first_difference"] is None and res["named"] is None and res["op"] is None
    assert "the gap is precision" in res["finding"]
    assert all(not m for m in res["missing"].values())
    # bf16 against fp32 is not zero: the comparison sees differences where there are some.
    assert res["curves"]["precision"]["median"][points.index("logits")] > 1e-4
    assert res["curves"]["engine"] == res["curves"]["precision"]
    assert res["logits"]["engine"] == res["logits"]["precision"]


def nudged(master, layer: int, module: str, factor: float = 1.05, row: int | None = None
           ) -> HFEngine:
    """The same-kernels engine with one module's weight (or one output row of it) scaled."""
    eng = same_kernels_engine(master)
    with torch.no_grad():
        w = dict(eng.model.named_parameters())[f"model.layers.{layer}.{module}.weight"]
        (w if row is None else w[row]).mul_(factor)
    return eng


@pytest.mark.parametrize("layer,module,point,op", [
    (1, "mlp.down_proj", "mlp", "matmul"), (2, "self_attn.o_proj", "attention", "matmul"),
    (3, "input_layernorm", "input_norm", "norm"), (1, "self_attn.k_proj", "k", "matmul"),
    (2, "mlp.gate_proj", "gate", "matmul")])
def test_a_nudged_op_is_named_and_nothing_before_it(master, layer, module, point, op):
    res = loc.locate(master, nudged(master, layer, module), settings(), sequences(), "engine=hf")
    first = f"layers.{layer}.{point}"
    assert res["named"]["point"] == first and res["op"] == op
    assert res["named"]["pass"] == "prefill" and res["named"]["low"] > 2
    assert res["first_difference"] == first
    i = res["points"].index(first)
    ev = res["curves"]["engine_vs_precision"]
    assert ev["max"][:i] == [0.0] * i and ev["median"][i] > 0
    assert f"from {tr.describe(first)} ({op})" in res["finding"]
    advice = loc.advice({"metrics": {}, "locate": {"self_gap": [], "layers": res}})
    assert advice == [f"where the engine's kernels matter: {tr.describe(first)} ({op}); "
                      f"{fd.SUGGEST[op]}"]


def rms_norm_weight_in_fp32(self, hidden_states):
    """The cast order one serving release used: the weight multiplied in fp32, then the product
    cast (transformers casts first, then multiplies in the weight's dtype)."""
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.float() * x).to(hidden_states.dtype)


def test_a_norm_in_the_other_cast_order_is_its_first_bit_and_a_rounding_names_nothing(master):
    """One norm whose casts differ by a rounding: the first bit-level difference, said as a
    detail; a difference of a rounding's size does not rise above precision, so it is not the
    finding."""
    eng = same_kernels_engine(master)
    norm = eng.model.model.layers[2].post_attention_layernorm
    norm.forward = rms_norm_weight_in_fp32.__get__(norm)
    res = loc.locate(master, eng, settings(), sequences(), "engine=hf")
    assert res["first_difference"] == "layers.2.post_norm" and res["named"] is None
    assert res["details"] == ["first bit-level difference from the trainer's own bf16 forward: "
                              "layer 2's post-attention norm (norm)"]
    assert "the gap is precision" in res["finding"]


def test_without_an_engine_only_the_precision_curve_is_drawn(master):
    res = loc.locate(master, None, settings(), sequences(2), "answers from a file")
    assert set(res["curves"]) == {"precision", "precision_last"}
    assert res["first_difference"] is None and res["named"] is None
    assert "not traced" in res["finding"] and loc.advice(
        {"metrics": {}, "locate": {"self_gap": [], "layers": res}}) == []


def rollout(lengths: list[tuple[int, int]], vocab: int = 96, seed: int = 2) -> Rollout:
    """Left-padded prompts and right-padded completions of the given (prompt, completion)
    lengths."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(lengths), max(p for p, _ in lengths), max(c for _, c in lengths)
    pm = torch.tensor([[int(j >= P - p) for j in range(P)] for p, _ in lengths])
    cm = torch.tensor([[float(j < c) for j in range(T)] for _, c in lengths])
    ids = torch.randint(2, vocab, (B, P), generator=g) * pm
    comp = torch.randint(2, vocab, (B, T), generator=g) * cm.long()
    return Rollout(ids, pm, comp, cm, torch.zeros(B, T), torch.ones(B, dtype=torch.bool))


@pytest.mark.parametrize("s", [Sampling(), Sampling(0.7, 0.9, 20, repetition_penalty=1.3)])
def test_right_padding_scores_the_same_tokens_as_left_padding_in_float64(master, s):
    """Two layouts of the same tokens at the same positions: in float64 they agree to rounding,
    so the layout code moves no token."""
    model = LlamaForCausalLM(master.config).double().eval()
    model.load_state_dict(master.state_dict())
    r = rollout([(5, 7), (9, 3), (2, 8), (7, 7)])
    with torch.no_grad():
        left = score_full(model, r, s).logp
        right = score_right_padded(model, r, s)
    assert (left - right).abs().max() < 1e-9
    assert right[r.completion_mask == 0].eq(0).all()


def by_hand(model, r: Rollout, layout: str) -> torch.Tensor:
    """ℓ of each completion token recomputed in float64 from one forward per layout, written
    independently of parity's scoring: 'batch' (left padding, the whole batch), 'one' (each
    row alone) or 'right' (the whole batch, padding on the right)."""
    B, T = r.completion_ids.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    rows = [(r.prompt_ids[b][r.prompt_mask[b] > 0].tolist(),
             r.completion_ids[b][r.completion_mask[b] > 0].tolist()) for b in range(B)]

    def logp(logits, at: int, toks: list[int]) -> torch.Tensor:
        lp = torch.log_softmax(logits.double(), -1)
        return torch.stack([lp[at - 1 + j, t] for j, t in enumerate(toks)])

    if layout == "one":
        for b, (p, c) in enumerate(rows):
            n = len(p) + len(c)
            logits = model(input_ids=torch.tensor([p + c]), attention_mask=torch.ones(1, n),
                           position_ids=torch.arange(n)[None]).logits[0]
            out[b, :len(c)] = logp(logits, len(p), c)
        return out
    L = r.prompt_ids.shape[1] + T   # both layouts keep the batch's width
    ids, mask = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    starts = []
    for b, (p, c) in enumerate(rows):
        a = 0 if layout == "right" else r.prompt_ids.shape[1] - len(p)
        ids[b, a:a + len(p) + len(c)] = torch.tensor(p + c)
        mask[b, a:a + len(p) + len(c)] = 1
        starts.append(a)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for b, (p, c) in enumerate(rows):
        out[b, :len(c)] = logp(logits[b], starts[b] + len(p), c)
    return out


@torch.no_grad()
def test_the_trainer_against_itself_reproduces_a_float64_recomputation(master):
    """bf16 shadow and fp32 trainer, micro-batch 1 and right padding against the whole batch
    with left padding: parity's figures are a float64 recomputation's, from the same forwards."""
    r = rollout([(5, 7), (9, 3), (2, 8), (7, 7), (4, 1), (8, 6)])
    s = Sampling()
    shadow = Shadow(master, "bf16", "fp32", kernels="trainer")
    gap = loc.SelfGap("fp32", "bf16")
    mask = r.completion_mask
    logp_pi = score_full(master, r, s).logp
    logp_s = shadow.logprobs(master, r, s, logp_pi)
    gap.add(master, shadow, r, s, logp_pi, logp_s, mask, "emulate", 0, rows=4)
    got = {(x["forward"], x["change"]): x for x in gap.results()}
    for side, model in (("trainer", master), ("shadow", shadow.model)):
        ref = by_hand(model, r, "batch")
        # micro-batch 1 on the first 4 completions; right padding on the whole batch
        for change, layout, rows in (("batch_1", "one", 4), ("right_pad", "right", 6)):
            keep = mask[:rows] > 0
            d = (by_hand(model, r, layout)[:rows] - ref[:rows])[keep].abs()
            x = got[(side, change)]
            assert x["tokens"] == int(keep.sum())
            # parity's ℓ are float32: a few of their ulps (about 5e-7 at |ℓ| = 4.5) apart
            assert x["abs_mean"] == pytest.approx(float(d.mean()), rel=1e-3, abs=2e-6)
            assert x["abs_max"] == pytest.approx(float(d.max()), rel=1e-3, abs=2e-6)
            assert x["frac_outside"] == pytest.approx(float((d > loc.OUTSIDE).double().mean()),
                                                      abs=1.5 / d.numel())
    # bf16 moves with the layout, so the figures above compare numbers that are not all zero.
    assert got[("shadow", "batch_1")]["abs_max"] > 0


@torch.no_grad()
def test_the_trainer_against_itself_is_zero_in_fp32_at_the_same_micro_batch(master):
    """One unpadded completion: micro-batch 1 is the audit's micro-batch and there is no padding
    to move, so an fp32 trainer agrees with itself exactly."""
    r = rollout([(6, 5)])
    s = Sampling()
    shadow = Shadow(master, "fp32", "fp32")
    gap = loc.SelfGap("fp32", "fp32")
    logp_pi = score_full(master, r, s).logp
    gap.add(master, shadow, r, s, logp_pi, logp_pi, r.completion_mask, "emulate", 0, rows=1)
    rows = gap.results()
    assert [x["forward"] for x in rows] == ["trainer", "trainer"]
    assert all(x["abs_mean"] == 0 and x["abs_max"] == 0 and x["frac_outside"] == 0
               for x in rows)
    assert "fp32 on both sides" in gap.note


def test_an_engine_that_cannot_be_traced_is_refused_in_one_line():
    with pytest.raises(ParityError) as e:
        refuse_what_it_cannot("other", EngineCan(False, False, False), EngineNeeds(trace=True),
                              engines_that)
    assert str(e.value) == ("engine=other cannot be traced op by op: --locate needs "
                            "engine=hf or engine=vllm")
    assert all(ENGINES[n].can.trace for n in ("hf", "vllm"))


@pytest.mark.e2e
def test_audit_locate_end_to_end(tmp_path, text_model):
    out = tmp_path / "a"
    p = run_main("audit", "--model", str(text_model), "--task", "neg-length", "--samples", "16",
                 "--group", "4", "--max-new-tokens", "8", "--batch-size", "8", "--locate",
                 "--locate-sequences", "3", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "the trainer against itself" in p.stdout
    assert "where the gap comes from: " in p.stdout
    res = json.loads((out / "audit.json").read_text())
    located = res["locate"]
    assert {(x["forward"], x["change"]) for x in located["self_gap"]} == {
        (f, c) for f in ("trainer", "shadow") for c in ("batch_1", "right_pad")}
    # the first batch of 8 completions, all 8 of them also one at a time (--locate-rows 8)
    counts = {x["tokens"] for x in located["self_gap"]}
    assert len(counts) == 1 and 0 < counts.pop() < res["tokens"]
    layers = located["layers"]
    assert layers["sequences"] == 3
    assert set(layers["curves"]) == set(loc.COMPARISONS) | {"precision_last"}
    n = len(layers["points"])
    assert all(len(c["median"]) == n and None not in c["median"]
               for c in layers["curves"].values())
    assert layers["finding"] in p.stdout.replace("\n", " ") or \
        layers["finding"][:60] in p.stdout
    assert any("trainer against itself" in r for r in res["advice"]["reasons"])
    assert located["seconds"]["self_gap"] > 0 and located["seconds"]["layers"] > 0
    page = (out / "report.html").read_text()
    assert "Where the gap comes from" in page and 'alt="relative error against layer"' in page
    assert "The trainer against itself" in page and (out / "locate.png").exists()


@pytest.mark.e2e
def test_an_audit_without_locate_has_none_of_it(tmp_path, text_model):
    out = tmp_path / "a"
    p = run_main("audit", "--model", str(text_model), "--task", "neg-length", "--samples", "8",
                 "--group", "4", "--max-new-tokens", "6", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "locate" not in json.loads((out / "audit.json").read_text())
    assert "where the gap comes from" not in p.stdout and not (out / "locate.png").exists()


def test_an_overflowing_forward_gives_numbers_and_counts_the_tokens():
    """A traced point that overflowed (inf, or NaN after it) is counted per point, left out of
    the median and max, and still names the point where the engine parts."""
    located = loc.Located(["embed", "logits"])
    located.add("engine_vs_precision", {"embed": torch.tensor([0.0, 0.0]),
                                        "logits": torch.tensor([float("inf"), 0.5,
                                                                float("nan")])})
    c = located.curve("engine_vs_precision")
    assert c == {"median": [0.0, 0.5], "max": [0.0, 0.5], "non_finite": [0, 2]}
    assert loc.first_difference(located) == "logits"
    located.add("engine_vs_precision", {"embed": torch.tensor([float("nan")])})
    assert loc.first_difference(located) == "embed"
    assert loc.Located(["embed"]).curve("engine") == {"median": [None], "max": [None],
                                                      "non_finite": [0]}
    # an overflow where precision stays finite rises above it
    assert fd.rise(torch.tensor([float("inf"), 1.0, float("nan")]),
                   torch.tensor([1e-3, 1e-3, 1e-3]))["ratio"] == float("inf")


@pytest.mark.parametrize("moved,told,not_told", [
    (0.03, "no engine recipe removes that part", "not the trainer's own"),
    (1e-6, "the gap is not the trainer's own", "no engine recipe")])
def test_the_advice_acts_on_the_trainers_own_gap_only_where_it_matters(moved, told, not_told):
    row = {"forward": "shadow", "dtype": "bf16", "change": "batch_1", "tokens": 10,
           "abs_mean": moved, "abs_max": moved, "frac_outside": 0.0}
    lines = loc.advice({"metrics": {"mismatch/beta_abs_mean": 0.04},
                        "locate": {"self_gap": [row], "layers": None}})
    assert len(lines) == 1 and told in lines[0] and not_told not in lines[0]


@pytest.mark.e2e
def test_what_locate_cannot_trace_is_refused_before_anything_is_sampled(vllm_ready):
    """A trainer's model without decoder layers to follow, and a model whose layers in vLLM the
    hooks do not know, are refused in one line each before the audit samples."""
    from transformers import GPT2Config

    from parity.engines import check_engine
    with pytest.raises(ParityError, match=r"^--locate: Linear: no decoder layers found to trace; "
                                          r"the trace knows the Llama, Qwen and GPT-2"):
        loc.check_traceable(torch.nn.Linear(2, 2))
    gpt2 = GPT2Config(n_embd=128, n_head=2, n_layer=1, vocab_size=64,
                      architectures=["GPT2LMHeadModel"])
    with pytest.raises(ParityError, match=r"^engine=vllm: --locate traces vLLM's "
                                          r"LlamaForCausalLM, .*not GPT2LMHeadModel; use "
                                          r"engine=hf$"):
        check_engine("vllm", gpt2, EngineNeeds(trace=True))
    check_engine("vllm", gpt2, EngineNeeds())   # without --locate vLLM runs it
