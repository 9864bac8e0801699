"""No update from a non-finite gradient, on every path that steps an optimizer: `parity train`
(one process, LoRA, the asynchronous engine, FSDP2 under torchrun) and TRL's GRPOTrainer with
parity (AsyncGRPO: tests/test_trl_async.py). A NaN is injected into the backward of the first
decoder layer only, so the loss and ℓ_π stay finite and the gradient alone is not: the update
is skipped, the weights stay as they were bit for bit, the first skip is named in one warning,
and the run stops after `max_consecutive_skips` in a row with its checkpoints intact."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity.errors import ParityError

pytestmark = pytest.mark.e2e

STOP = (r"step 3: 3 updates in a row skipped for a non-finite gradient \(the gradient of "
        r"\S+; max_consecutive_skips=3\): training stops, its weights the initial ones")


class NanGrad(torch.autograd.Function):
    """The identity, whose backward is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def poison(model: torch.nn.Module, steps: set[int] | None = None) -> list[int]:
    """A NaN into the gradient of every weight up to the first decoder layer, at every forward
    with gradient (or only at the `steps`-th of them, counted from 1); returns the counter."""
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    seen = [0]

    def hook(module, args, out):
        if not torch.is_grad_enabled():
            return out
        seen[0] += 1
        if steps is not None and seen[0] not in steps:
            return out
        if isinstance(out, tuple):
            return (NanGrad.apply(out[0]), *out[1:])
        return NanGrad.apply(out)
    layer.register_forward_hook(hook)
    return seen


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(model_or_state, before: dict[str, torch.Tensor]) -> None:
    state = (model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module)
             else model_or_state)
    for k, v in before.items():
        assert torch.equal(state[k], v), k


def _cfg(tmp_path: Path, **kw):
    from parity.config import make_config
    return make_config({"task": "neg-length", "model": "text-xs", "steps": 6,
                        "prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 8,
                        "save_every": 1, "max_consecutive_skips": 3, "progress": False,
                        "report_to": "none", "threads": 1, "out": str(tmp_path / "run"), **kw})


@pytest.mark.parametrize("path", ["one-process", "lora", "async-engine"])
def test_parity_train_skips_and_stops(path, tmp_path, capsys, text_model):
    from parity.trainer import train
    kw = {"lora": {"lora_rank": 4},
          "async-engine": {"async_engine": True, "max_staleness": 0}}.get(path, {})
    held = {}

    def inject(model):
        held["model"], held["before"] = model, snapshot(model)
        poison(model)
    with pytest.raises(ParityError, match=f"^{STOP}"):
        train(_cfg(tmp_path, **kw), on_model=inject)
    assert_same(held["model"], held["before"])
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if "update skipped" in x]
    assert len(warnings) == 1 and warnings[0].startswith(
        "parity: warning: step 1: update skipped, the gradient of ")
    # the checkpoints of steps 1 and 2 are on disk, whole, with the weights never updated
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-1", "step-2"]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["train/skipped_updates"] for r in rows] == [1, 2]


def test_one_skipped_update_is_counted_and_the_next_one_applied(tmp_path, text_model):
    from parity.trainer import train
    held = {}

    def inject(model):
        held["model"], held["before"] = model, snapshot(model)
        poison(model, steps={1})
    out = train(_cfg(tmp_path, steps=3), on_model=inject)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_this_step"] for r in rows] == [1, 0, 0]
    assert rows[0]["train/grad_norm"] is None and rows[1]["train/grad_norm"] > 0
    step1 = load_file(out / "checkpoints" / "step-1" / "model.safetensors")
    assert_same(step1, {k: v for k, v in held["before"].items() if k in step1})
    assert not all(torch.equal(held["model"].state_dict()[k], v)
                   for k, v in held["before"].items())


FSDP_RANK = r"""
import sys
sys.path.insert(0, sys.argv[1])
from test_skipped_updates import _cfg, poison
from pathlib import Path
from parity.errors import ParityError
from parity.trainer import train
import os
try:
    train(_cfg(Path(sys.argv[2]), parallel="fsdp"), on_model=lambda m: poison(m))
except ParityError as e:
    # a file per rank: the two ranks' stdout reach the test interleaved
    (Path(sys.argv[2]) / f"stopped-{os.environ['RANK']}.txt").write_text(f"STOPPED: {e}")
"""


def test_fsdp_ranks_skip_together_and_stop(tmp_path, text_model):
    from test_distributed import TORCHRUN, TORN
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = tmp_path / "rank.py"
    script.write_text(FSDP_RANK)
    for _ in range(3):    # the gloo abort tests/test_distributed.py retries
        # a retry starts as the first attempt did, without what an aborted one left behind
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        for f in tmp_path.glob("stopped-*.txt"):
            f.unlink()
        p = subprocess.run(TORCHRUN + [str(script), str(Path(__file__).parent), str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=900)
        if TORN not in p.stderr:
            break
    stops = [f.read_text() for f in sorted(tmp_path.glob("stopped-*.txt"))]
    assert len(stops) == 2 and all(re.match(f"STOPPED: {STOP}", x) for x in stops), \
        p.stdout + p.stderr[-3000:]
    step2 = load_file(tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in step2.values())


# -- TRL's GRPOTrainer -----------------------------------------------------------------------

def _trl(text_model, tmp_path, steps, **opts):
    sys.path.insert(0, str(Path(__file__).parent))
    from transformers import AutoModelForCausalLM

    from parity.integrations.trl import ParityOptions
    from test_trl import _trainer
    model = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    return model, lambda: _trainer(text_model, tmp_path, steps=steps, model=model,
                                   parity=ParityOptions.from_recipe("bf16-engine", **opts))


def test_trl_skips_a_non_finite_gradient_and_stops(text_model, tmp_path, caplog):
    model, make = _trl(text_model, tmp_path, steps=5, max_consecutive_skips=3)
    t = make()
    before = snapshot(model)
    poison(model)
    with pytest.raises(ParityError, match=f"^{STOP}"):
        t.train()
    assert_same(model, before)
    warned = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "parity: step 1: update skipped, the gradient of model.embed_tokens.weight")
    # the learning-rate schedule waited, as for accelerate's own skipped steps
    assert t.lr_scheduler.last_epoch == 0


def test_trl_counts_one_skipped_update_and_applies_the_next(text_model, tmp_path):
    from transformers import TrainerCallback
    model, make = _trl(text_model, tmp_path, steps=2)
    t = make()
    before, after_first = snapshot(model), {}

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                after_first.update(snapshot(model))
    t.add_callback(Keep())
    poison(model, steps={1})    # one micro-batch per step here
    t.train()
    assert_same(after_first, before)
    lines = [h for h in t.state.log_history if "train/skipped_updates" in h]
    assert len(lines) >= 2 and {h["train/skipped_updates"] for h in lines} == {1}
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.isfinite(p).all() for p in model.parameters())
