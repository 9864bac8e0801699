"""examples/minimal_grpo.py, parity's idea in one file, is the reference the library is checked
against: run as a user runs it, beside `parity train` with the same seed and settings, it must
sample the same tokens and report the same figures, step by step."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "minimal_grpo.py"
# The bf16-engine recipe (bf16 engine, fp32 trainer, log r = ℓ_π − ℓ_μ) at a clip range of the
# order of text-xs's |β| (docs/design.md: 6e-3), so that β alone clips tokens: phantom clips to
# compare; two epochs, so that the second update's α holds the first one's move and hidden clips
# occur; a processed sampling distribution (temperature, top-k, top-p). Steps 2 and 3 sample
# from weights that the updates before them moved, so their tokens agree only if those updates
# did, bit for bit. On the CPU, one thread each: a product's rounding may depend on how many
# threads share it.
SETTINGS = dict(steps=3, prompts_per_step=2, samples_per_prompt=4, max_new_tokens=16, lr=3e-4,
                eps_low=0.004, eps_high=0.004, epochs=2, temperature=0.8, top_p=0.9, top_k=50,
                seed=0, threads=1)
# Compared exactly: both sides run the same operations in the same order on the same tokens.
# Where the script attends with transformers' eager attention, parity's engine and shadow attend
# with its own (parity/models/attention.py): the same arithmetic, for a model without
# grouped-query heads (text-xs) on the very same products.
SAME = ("reward/mean", "completion/len_mean", "clip/frac", "clip/phantom_frac",
        "clip/hidden_frac", "clip/alpha_frac", "mismatch/beta_abs_mean", "mismatch/beta_mean",
        "mismatch/alpha_abs_mean", "loss/policy")


def test_the_script_stays_minimal():
    src = SCRIPT.read_text()
    assert len(src.splitlines()) <= 300
    imports = {a.name.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import)
               for a in n.names}
    imports |= {n.module.split(".")[0] for n in ast.walk(ast.parse(src))
                if isinstance(n, ast.ImportFrom) and n.module}
    assert "parity" not in imports
    assert imports - set(sys.stdlib_module_names) == {"torch", "transformers"}


# The script runs torch's own bf16 kernels; on a CPU without bf16 instructions parity would emulate
# them with fp32 ones (parity/cpu_bf16.py), whose sums round apart now and then, so parity runs
# torch's here too. On an AVX2-only CPU the emulated run's β differed from step 2 on by 5e-4.
NATIVE = {**os.environ, "PARITY_CPU_BF16": "native"}


def _flags(**kw) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]


@pytest.mark.e2e
def test_the_script_reports_what_parity_train_logs(text_model, tmp_path):
    from parity.tasks.data import text_prompts
    prompts = tmp_path / "prompts.jsonl"  # the neg-length task's rows, in the task's order
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in text_prompts(256, seed=SETTINGS["seed"])))
    # Both at once, one thread each, as a user would run them.
    script = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(text_model), "--prompts", str(prompts),
         *_flags(**SETTINGS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run, log = tmp_path / "run", tmp_path / "parity.log"
    with log.open("w") as f:
        parity = subprocess.Popen(
            [sys.executable, "-m", "parity", "train", "--task", "neg-length", "--recipe",
             "bf16-engine", "--model", str(text_model), "--device", "cpu", "--out", str(run),
             "--no-progress", "--report-to", "none", *_flags(**SETTINGS)],
            stdout=f, stderr=subprocess.STDOUT, env=NATIVE)
        out, err = script.communicate(timeout=300)
        assert parity.wait(timeout=300) == 0, log.read_text()
    assert script.returncode == 0, err
    mine = [json.loads(line) for line in out.splitlines()]
    theirs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for m, t in zip(mine, theirs, strict=True):
        print(json.dumps({k: (m[k], t[k]) for k in ("step", *SAME)}))
        assert m["step"] == t["step"]
        for k in SAME:
            assert m[k] == t[k], (m["step"], k, m[k], t[k])
    assert len(mine) == SETTINGS["steps"]
    # Figures worth comparing: the clip range catches some tokens, and not all of them; some
    # of those are phantom clips, and some tokens are hidden; the policy moves (the rewards
    # change).
    assert any(0 < m["clip/frac"] < 1 for m in mine)
    assert any(m["clip/phantom_frac"] > 0 for m in mine)
    assert any(m["clip/hidden_frac"] > 0 for m in mine)
    assert all(m["mismatch/beta_abs_mean"] > 0 for m in mine)
    assert len({m["reward/mean"] for m in mine}) > 1
