"""The zero-mismatch certificate (parity/config/certificate.py): judged exactly on hand-made
figures, then end to end: `parity audit --certify bitwise` exits 0 with the invariant kernels
and 1 without them, naming the first check that differs; a bad rule exits 2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli_helpers import run_main
from parity import cpu_bf16
from parity import metric_names as mn
from parity.config import certificate as cert

POINTS = ["embed", "layers.0.attn", "layers.0.mlp", "logits"]


def _result(engine=0.0, decode=0.0, layout=0.0, kl=0.0):
    curve = lambda x: {"max": [0.0, x, 0.0, 0.0], "median": [0.0] * 4, "non_finite": [0] * 4}
    return {"metrics": {mn.KL_K3: kl},
            "locate": {"self_gap": [{"forward": "trainer", "change": c, "tokens": 10,
                                     "abs_max": layout if c == "right_pad" else 0.0}
                                    for c in ("batch_1", "right_pad")]
                       + [{"forward": "shadow", "change": "batch_1", "tokens": 10,
                           "abs_max": 0.5}],
                       "layers": {"points": POINTS,
                                  "curves": {"engine": curve(engine),
                                             "decode_vs_prefill": curve(decode)}}}}


def test_bitwise_holds_only_where_every_check_is_exactly_zero():
    c = cert.certificate(_result(), 0.0, 1.0, "bitwise")
    assert c["holds"] and all(k["holds"] for k in c["checks"])   # the shadow's rows not judged
    assert "bitwise: every check holds to the bit" in cert.line(c)
    for kw, check, at in ((dict(layout=1e-9), "trainer layouts", "right_pad"),
                          (dict(engine=2e-8), "trainer vs engine", "layers.0.attn"),
                          (dict(decode=3e-7), "decode vs prefill", "layers.0.attn")):
        c = cert.certificate(_result(**kw), 0.0, 1.0, "bitwise")
        failed = [k for k in c["checks"] if not k["holds"]]
        assert not c["holds"] and [k["check"] for k in failed] == [check]
        assert failed[0]["at"] == at and f"{check} differs at {at}" in cert.line(c)
    # a sampled token's log-prob one ulp apart fails the second check where no op differs;
    # where one does, the op is named and the tokens' gap beside it
    c = cert.certificate(_result(), 2 ** -23, 1.0, "bitwise")
    assert c["checks"][1]["at"] == "sampled tokens' log-probs"
    assert c["checks"][1]["value"] == 2 ** -23
    c = cert.certificate(_result(engine=1e-3), 0.5, 1.0, "bitwise")
    assert "trainer vs engine differs at layers.0.attn by 0.001 (sampled tokens' |Δℓ| up to " \
        "0.5)" in cert.line(c)
    # an untraced engine proves nothing
    r = _result()
    del r["locate"]["layers"]["curves"]["decode_vs_prefill"]
    assert not cert.certificate(r, 0.0, 1.0, "bitwise")["holds"]


def test_the_other_frameworks_bars_at_their_edges():
    ok = cert.certificate(_result(engine=1e-3, kl=0.015), 0.1, math.log(1.05), "nemo-rl")
    assert ok["holds"] and ok["bars"]["prime-rl"]["holds"] and not ok["checks"][1]["holds"]
    assert not cert.certificate(_result(), 0.1, math.log(1.0501), "nemo-rl")["holds"]
    assert not cert.certificate(_result(kl=0.0151), 0.1, 0.0, "prime-rl")["holds"]
    assert not cert.certificate(_result(), None, None, "nemo-rl")["holds"]   # nothing measured


def test_nemo_rls_bar_stays_finite_past_exps_range():
    # hand-computed: mean exp of (0, ln 3) is 2; of (0, 1000) is (1 + e^1000) / 2
    assert cert.log_mean_exp(torch.tensor([0.0, math.log(3.0)])) == pytest.approx(math.log(2))
    big = cert.log_mean_exp(torch.tensor([0.0, 1000.0]))
    assert big == pytest.approx(1000 - math.log(2))
    c = cert.certificate(_result(), 1000.0, big, "nemo-rl")
    bar = c["bars"]["nemo-rl"]
    assert bar["value"] is None and not bar["holds"] and json.dumps(c, allow_nan=False)
    assert "nemo-rl e^999.3 against 1.05 (fails)" in cert.line(c)
    assert cert.certificate(_result(), 0.0, 0.0, "nemo-rl")["bars"]["nemo-rl"]["value"] == 1.0


@pytest.mark.e2e
def test_audit_certify_exits_by_the_certificate(tmp_path, text_model):
    common = ["audit", "--model", str(text_model), "--task", "neg-length", "--samples", "16",
              "--group", "4", "--max-new-tokens", "12", "--batch-size", "8",
              "--engine-dtype", "bf16", "--trainer-dtype", "bf16", "--certify", "bitwise",
              "--no-progress"]
    before = cpu_bf16.padding()
    p = run_main(*common, "--kernels", "invariant", "--out", tmp_path / "on")
    assert p.returncode == 0, p.stdout + p.stderr
    assert cpu_bf16.padding() == before     # the audit's padding ends with it, in this process
    assert "certificate (bitwise: passes): bitwise" in p.stdout.replace("\n", " ")
    res = json.loads((tmp_path / "on" / "audit.json").read_text())
    assert res["certificate"]["holds"] and res["kernels"] == "invariant"
    assert res["metrics"][mn.LOG_RATIO_ABS_MAX] == 0 and res["metrics"][mn.KL_K3] == 0
    p = run_main(*common, "--out", tmp_path / "off")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "not bitwise: " in p.stdout.replace("\n", " ")
    res = json.loads((tmp_path / "off" / "audit.json").read_text())
    assert not res["certificate"]["holds"]
    p = run_main(*common, "--certify", "exact", "--out", tmp_path / "bad")
    assert p.returncode == 2 and "certify" in p.stderr and "bitwise" in p.stderr
