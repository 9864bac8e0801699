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

from parity.fp16_check import GradAccum, judge, tensor_stats

OVER = "model.layers.0.mlp.down_proj.weight"  # scaled past 65504 itself
NORM = "model.norm.weight"  # scaled to stay < 65504 while the logits it feeds overflow


def parity(*args):
    """The command as a real subprocess."""
    return subprocess.run([sys.executable, "-m", "parity", "fp16-check", "--no-progress", *args],
                          capture_output=True, text=True, env=dict(os.environ), timeout=300)


def parity_here(capsys, *args):
    """The same entry point in this process: saves an interpreter start and a torch import."""
    from parity.cli import main
    capsys.readouterr()
    code = main(["fp16-check", "--no-progress", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


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
    from parity.runs import load_policy
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


def _gradients_only(grad: torch.Tensor) -> dict:
    """A result with fine weights and activations and one parameter gradient `grad`."""
    acc = GradAccum().add(grad)
    settled = min(16, math.floor(math.log2(65504 / acc.max_abs)))
    return {"weights": {"layer.weight": tensor_stats(torch.ones(2))}, "activations": {},
            "fp16_forward": {"nonfinite_prompts": 0}, "prompts": {"count": 1},
            "gradients": {"max_abs": acc.max_abs, "settled_scale": 2.0**settled,
                          "params": {"layer.weight": acc.summary(settled)}, "activations": {}}}


def test_verdict_underflow_risk_only_when_scaling_cannot_recover():
    # half the values at 2**-30: lost unscaled, recovered by a scale of 2**16
    v = judge(_gradients_only(torch.tensor([0.5, 2**-30] * 50)))
    assert v["verdict"] == {"inference": "OK", "training": "OK"}
    assert any("loss scaling" in s for s in v["suggestions"])
    # a gradient of 1e3 forces the scale down to 2**6, where 2**-40 values stay lost
    v = judge(_gradients_only(torch.tensor([1e3] + [2**-40] * 99)))
    assert v["verdict"] == {"inference": "OK", "training": "UNDERFLOW-RISK"}
    assert "layer.weight: 99.0%" in v["reasons"]["training"][0]


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


def test_activation_overflow_with_every_weight_in_range(scaled, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The history of the city\n\nIn mathematics, a group is\nimport os\n")
    out = tmp_path / "check"
    p = parity_here(capsys, "--model", str(scaled["activation"]), "--prompts", str(prompts),
                    "--out", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads((out / "fp16_check.json").read_text())
    assert r["prompts"]["count"] == 3
    assert max(w["max_abs"] for w in r["weights"].values()) < 65504  # the weights alone pass
    assert r["weights"][NORM]["max_abs"] > 10_000
    assert r["verdict"]["inference"] == "OVERFLOW"
    assert r["activations"]["lm_head"]["over_max"] > 0
    assert not any("weight" in x for x in r["reasons"]["inference"])
    assert "lm_head" in r["reasons"]["inference"][0] and "model.norm" in r["reasons"]["inference"][0]
    assert r["fp16_forward"]["nonfinite_prompts"] == 3
    assert "lm_head" in p.stdout and "OVERFLOW" in p.stdout


def test_ordinary_model_passes_and_writes_to_a_fresh_directory(text_model, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = parity_here(capsys, "--model", "text-xs")
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
    assert acts["model.embed_tokens"]["order"] < acts["model.norm"]["order"] < acts["lm_head"]["order"]
    assert acts["lm_head"]["leaf"] and not acts["model.layers.0"]["leaf"]
    f = r["fp16_forward"]
    assert f["nonfinite_prompts"] == 0 and 0 < f["max_logit_diff"] < 0.5
    g = r["gradients"]
    assert 0 < g["max_abs"] < 65504 / 2**16 and g["settled_scale"] == 2**16
    assert set(g["params"]) == set(r["weights"])
    # the module outputs' gradients are seen too, down to the first layer
    assert g["activations"]["lm_head"]["nonzero"] > 0
    assert g["activations"]["model.layers.0.self_attn.q_proj"]["max_abs"] > 0


def test_bad_model_and_bad_prompts_are_one_line_errors(text_model, tmp_path, capsys):
    one_error_line(parity("--model", str(tmp_path / "nope")), "no model directory")
    (tmp_path / "blank.txt").write_text("\n  \n")
    for prompts, words in (("missing.txt", ("missing.txt", "does not exist")),
                           ("blank.txt", ("no non-empty lines",))):
        one_error_line(parity_here(capsys, "--model", "text-xs", "--prompts",
                                   str(tmp_path / prompts), "--out", str(tmp_path / "never")),
                       *words)
    assert not (tmp_path / "never").exists()  # input is checked before anything is written
