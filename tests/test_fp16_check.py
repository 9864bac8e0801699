"""`parity fp16-check`: the range statistics against hand-computed values, and the command on
models pushed past FP16's range on purpose (a weight, or only an activation), on an ordinary
testbed model, and on bad input."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import run_main
from parity.fp16_check import GradAccum, judge, tensor_stats

OVER = "model.layers.0.mlp.down_proj.weight"  # scaled past 65504 itself
NORM = "model.norm.weight"  # scaled to stay < 65504 while the logits it feeds overflow


def parity(*args):
    """The command as a real subprocess."""
    return subprocess.run([sys.executable, "-m", "parity", "fp16-check", "--no-progress", *args],
                          capture_output=True, text=True, env=dict(os.environ), timeout=300)


def parity_here(*args):
    """The same entry point in this process: saves an interpreter start and a torch import."""
    return run_main("fp16-check", "--no-progress", *args)


def one_error_line(p, *words):
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("parity: error:")]
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def scaled(text_model, tmp_path_factory):
    """Two copies of text-xs: one with a weight matrix past FP16's max, one whose weights all
    fit but whose final norm is scaled so the logits overflow."""
    from parity.models.loading import load_policy
    dirs = {}
    for kind, name, factor in (("weight", OVER, 1e6), ("activation", NORM, 3e4)):
        model, tok = load_policy(text_model)
        with torch.no_grad():
            dict(model.named_parameters())[name].mul_(factor)
        d = tmp_path_factory.mktemp(f"scaled-{kind}")
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[kind] = d
    return dirs


def test_tensor_stats_hand_computed():
    t = torch.tensor([0.0, 1e5, -7e4, 65504.0, 1.0, 2**-15, -2**-20, 2**-25, 3e-8, math.nan])
    s = tensor_stats(t)
    assert s == {"numel": 10, "nonfinite": 1, "max_abs": 1e5, "over_max": 2, "nonzero": 8,
                 "below_normal": 4, "below_subnormal": 2}
    # what fp16 really does with them: the two counted over its max become inf, 65504 does not
    assert int(torch.isinf(t[1:4].half()).sum()) == 2
    assert t[7:9].half().float().tolist() == [0.0, 2**-24]  # below 2**-24: 0, or 2**-24 itself
    assert tensor_stats(torch.zeros(3))["max_abs"] == 0.0


def test_gradient_underflow_unscaled_and_at_a_loss_scale():
    g = torch.tensor([1.0, 2**-30, 2**-24, -2**-41, 0.0])
    s = GradAccum().add(g).summary(16)
    assert s["nonzero"] == 4 and s["max_abs"] == 1.0
    assert s["underflow_frac"] == 0.5          # 2**-30 and 2**-41; 2**-24 itself is kept
    assert s["underflow_frac_scaled"] == 0.25  # x 2**16: only 2**-41 stays below 2**-24
    total = 1 + 2**-60 + 2**-48 + 2**-82
    assert s["underflow_norm_frac"] == pytest.approx((2**-60 + 2**-82) / total, rel=1e-9)
    assert GradAccum().add(g).summary(20)["underflow_frac_scaled"] == 0.0


def _gradients_only(**grads: torch.Tensor) -> dict:
    """A result with fine weights and activations and these parameter gradients."""
    acc = {n.replace("_", "."): GradAccum().add(g) for n, g in grads.items()}
    settled = min(16, math.floor(math.log2(65504 / max(a.max_abs for a in acc.values()))))
    return {"weights": {"layer.weight": tensor_stats(torch.ones(2))}, "activations": {},
            "fp16_forward": {"nonfinite_prompts": 0}, "prompts": {"count": 1},
            "gradients": {"max_abs": max(a.max_abs for a in acc.values()),
                          "settled_scale": 2.0**settled,
                          "params": {n: a.summary(settled) for n, a in acc.items()},
                          "activations": {}}}


def test_verdict_underflow_risk_only_when_scaling_cannot_recover():
    # a gradient all at 2**-30: lost unscaled, recovered by a scale of 2**16
    v = judge(_gradients_only(layer_weight=torch.tensor([2**-30] * 100)))
    assert v["verdict"] == {"inference": "OK", "training": "OK"}
    assert any("loss scaling" in s for s in v["suggestions"])
    # a gradient of 1e3 forces the scale down to 2**6, where a tensor whose gradient is all
    # 2**-35 loses it all
    v = judge(_gradients_only(big_weight=torch.tensor([1e3] * 10),
                              small_weight=torch.tensor([2**-35] * 100)))
    assert v["verdict"] == {"inference": "OK", "training": "UNDERFLOW-RISK"}
    assert "small.weight: 100.0% of its norm" in v["reasons"]["training"][0]


def test_lost_values_that_carry_no_norm_are_no_risk():
    """99% of a gradient's values lost at the settled scale, but they carry 1e-25 of its norm:
    counting values would refuse this gradient, and nothing of its update is lost."""
    g = torch.tensor([1e3] + [2**-40] * 99)
    s = GradAccum().add(g).summary(6)
    assert s["underflow_frac_scaled"] == 0.99
    v = judge(_gradients_only(layer_weight=g))
    assert v["verdict"] == {"inference": "OK", "training": "OK"}
    assert not v["reasons"]["training"]


@pytest.mark.e2e
def test_weight_past_fp16_range_is_flagged(scaled, tmp_path):
    out = tmp_path / "check"
    p = parity("--model", str(scaled["weight"]), "--out", str(out), "--top", "5")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "inference in fp16: OVERFLOW" in p.stdout
    assert OVER in p.stdout
    r = json.loads((out / "fp16_check.json").read_text())
    assert r["verdict"] == {"inference": "OVERFLOW", "training": "OVERFLOW"}
    assert r["weights"][OVER]["max_abs"] > 65504 and r["weights"][OVER]["over_max"] > 0
    assert [n for n, w in r["weights"].items() if w["over_max"]] == [OVER]
    assert OVER in r["reasons"]["inference"][0]
    assert any("model.layers.0.mlp.down_proj" in s and "fp32" in s for s in r["suggestions"])
    # the real fp16 forward agrees with the prediction
    assert r["fp16_forward"]["nonfinite_prompts"] == r["prompts"]["count"]


@pytest.mark.e2e
def test_activation_overflow_with_every_weight_in_range(scaled, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The history of the city\n\nIn mathematics, a group is\nimport os\n")
    out = tmp_path / "check"
    p = parity_here("--model", str(scaled["activation"]), "--prompts", str(prompts),
                    "--out", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads((out / "fp16_check.json").read_text())
    assert r["prompts"]["count"] == 3
    assert max(w["max_abs"] for w in r["weights"].values()) < 65504  # the weights alone pass
    assert r["weights"][NORM]["max_abs"] > 10_000
    assert r["verdict"]["inference"] == "OVERFLOW"
    assert r["activations"]["lm_head"]["over_max"] > 0
    assert not any("weight" in x for x in r["reasons"]["inference"])
    first = r["reasons"]["inference"][0]
    assert "lm_head" in first and "model.norm" in first
    assert r["fp16_forward"]["nonfinite_prompts"] == 3
    assert "lm_head" in p.stdout and "OVERFLOW" in p.stdout


@pytest.mark.e2e
def test_ordinary_model_passes_and_writes_to_a_fresh_directory(text_model, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = parity_here("--model", "text-xs")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "inference in fp16: OK" in p.stdout
    assert "training in fp16 with loss scaling: OK" in p.stdout
    r = json.loads((tmp_path / "audits" / "text-xs-fp16-check" / "fp16_check.json").read_text())
    assert r["verdict"] == {"inference": "OK", "training": "OK"}
    assert r["prompts"]["count"] == 8
    assert all(s["over_max"] == 0 for s in (*r["weights"].values(), *r["activations"].values()))
    # one module output per module that runs, and the logits among them
    acts = r["activations"]
    assert {"lm_head", "model.norm", "model.layers.1.mlp.down_proj"} <= set(acts)
    assert acts["lm_head"]["numel"] == r["prompts"]["tokens"] * 512  # summed over the prompts
    order = {k: acts[k]["order"] for k in ("model.embed_tokens", "model.norm", "lm_head")}
    assert order["model.embed_tokens"] < order["model.norm"] < order["lm_head"]
    assert acts["lm_head"]["leaf"] and not acts["model.layers.0"]["leaf"]
    f = r["fp16_forward"]
    assert f["nonfinite_prompts"] == 0 and 0 < f["max_logit_diff"] < 0.5
    g = r["gradients"]
    assert 0 < g["max_abs"] < 65504 / 2**16 and g["settled_scale"] == 2**16
    assert set(g["params"]) == set(r["weights"])
    # the module outputs' gradients are seen too, down to the first layer
    assert g["activations"]["lm_head"]["nonzero"] > 0
    assert g["activations"]["model.layers.0.self_attn.q_proj"]["max_abs"] > 0


@pytest.mark.e2e
def test_bad_model_and_bad_prompts_are_one_line_errors(text_model, tmp_path):
    one_error_line(parity("--model", str(tmp_path / "nope")), "no model directory")
    (tmp_path / "blank.txt").write_text("\n  \n")
    for prompts, words in (("missing.txt", ("missing.txt", "does not exist")),
                           ("blank.txt", ("no non-empty lines",))):
        one_error_line(parity_here("--model", "text-xs", "--prompts",
                                   str(tmp_path / prompts), "--out", str(tmp_path / "never")),
                       *words)
    assert not (tmp_path / "never").exists()  # input is checked before anything is written


def _paired(text_model, d, c: float):
    """text-xs computing the same function, its final norm's weight times c and its LM head's
    divided by c: the head's gradient shrinks by c while the norm's grows by 1/c, so the loss
    scale settles low (the norm's gradient must stay below 65504) and the head's smallest
    gradient values fall below 2**-24. A model whose gradients span that range is where fp16
    training really does lose some."""
    from parity.models.loading import load_policy
    model, tok = load_policy(text_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(c)
        model.lm_head.weight.div_(c)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _fp16_gradients(model_dir, scale: float) -> dict[str, torch.Tensor]:
    """The LM-loss gradient fp16 training computes (parity's fp16 autocast, loss scaled by
    `scale`), and fp32's, over the check's prompts."""
    from parity import fp16_check
    from parity.models.loading import load_policy
    from parity.models.precision import autocast
    from parity.tasks.data import text_prompts
    out = {}
    for dtype, s in (("fp32", 1.0), ("fp16", scale)):
        model, tok = load_policy(model_dir)
        ids = fp16_check._encode(tok, text_prompts(8), 512)
        for x in ids:
            with autocast(dtype, torch.device("cpu"), "emulate"):
                logits = model(input_ids=x, use_cache=False).logits
            (torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
             / len(ids) * s).backward()
        out[dtype] = {n: p.grad / s for n, p in model.named_parameters()}
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("c,verdict", [(3e-5, "OK"), (1e-5, "UNDERFLOW-RISK")])
def test_the_norm_the_check_says_fp16_loses_is_what_fp16_gradients_lose(c, verdict, text_model,
                                                                        tmp_path):
    """The verdict against real fp16 arithmetic: at the loss scale the check predicts, the LM
    head's fp16 gradient is zero where fp32's is not on about the share of values the check
    counts, and what those zeros carry of fp32's norm is the share the check predicts. At
    c = 3e-5 a third of the head's gradient values are lost but 0.1% of its norm (a count of
    values would refuse the model); at c = 1e-5 more than 1% of the norm is lost."""
    from parity import fp16_check
    d = _paired(text_model, tmp_path / "model", c)
    r = fp16_check.check(str(d), max_prompts=8, out=tmp_path / "check", progress=False,
                         device="cpu")
    assert r["verdict"] == {"inference": "OK", "training": verdict}
    g = r["gradients"]
    head = g["params"]["lm_head.weight"]
    predicted = fp16_check.lost_norm(head, "_scaled")
    grads = _fp16_gradients(d, g["settled_scale"])
    g32, g16 = grads["fp32"]["lm_head.weight"], grads["fp16"]["lm_head.weight"]
    zeroed = (g16 == 0) & (g32 != 0)
    assert float(zeroed.sum()) / int((g32 != 0).sum()) == pytest.approx(
        head["underflow_frac_scaled"], abs=0.02)
    measured = float(g32[zeroed].norm() / g32.norm())
    assert predicted / 2 < measured < predicted * 2
    assert (measured > fp16_check.UNDERFLOW_RISK_NORM) == (verdict == "UNDERFLOW-RISK")
    if verdict == "OK":
        assert head["underflow_frac_scaled"] > 0.2   # the count rule would have refused it


@pytest.mark.e2e
def test_a_model_the_check_passes_trains_in_fp16_as_in_fp32(text_model):
    """Three Adam steps of the LM loss with parity's fp16 training (autocast, dynamic loss
    scaling, fp32 master weights) against fp32: the same losses to 1e-4 (5e-5 measured), the same
    updates to 3% of their norm (1.8% at most measured: Adam divides each coordinate by its own
    scale, which magnifies fp16's rounding of the smallest gradients)."""
    from parity.fp16_check import _encode
    from parity.models.loading import load_policy
    from parity.models.precision import LossScaler, autocast
    from parity.tasks.data import text_prompts
    runs = {}
    for dtype in ("fp32", "fp16"):
        model, tok = load_policy(text_model)
        ids = _encode(tok, text_prompts(8), 512)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = LossScaler(dtype, torch.device("cpu"))
        losses = []
        for _ in range(3):
            total = 0.0
            for x in ids:
                with autocast(dtype, torch.device("cpu"), "emulate"):
                    logits = model(input_ids=x, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
                scaler.backward(loss / len(ids))
                total += float(loss.detach()) / len(ids)
            scaler.step(opt, list(model.parameters()), 0.0)
            losses.append(total)
        runs[dtype] = losses, {n: p.detach() - start[n] for n, p in model.named_parameters()}
    assert runs["fp16"][0] == pytest.approx(runs["fp32"][0], rel=1e-4)
    for n, d32 in runs["fp32"][1].items():
        assert float((runs["fp16"][1][n] - d32).norm()) <= 0.03 * float(d32.norm()), n
