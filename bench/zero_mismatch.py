"""What zero mismatch costs: a training step with the `bitwise` recipe (kernels=invariant)
against bf16-shadow's and fp32's, on SmolLM2-135M and at Qwen3's vocabulary, side by side in
one run; and what each recipe leaves of the gap.

    python -m bench.zero_mismatch [--rounds 2] [--steps 3]
    python -m bench.zero_mismatch --json docs/data/bench/zero_mismatch.json

Each run is `parity train` in a fresh process (the allocator's state moves a CPU step's time:
docs/performance.md), the recipes alternating for `--rounds`; each run's first step is dropped
and the others averaged. Target (docs/zero-mismatch.md): bitwise's step at most 1.3x
bf16-shadow's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

from bench.report import Table, json_option, publish
from parity import metric_names as mn

RECIPES = ("fp32", "bf16-shadow", "bitwise")
# (model, task, prompts x samples, new tokens): SmolLM2 as a user trains it, and Qwen3's
# vocabulary on a narrow body, where the per-vocabulary work is a real model's.
MODELS = (("smollm2-135m", "neg-length-chat", 4, 2, 64),
          ("qwen3-narrow-shape", "neg-length", 2, 4, 128))
GAP = (mn.BETA_ABS_MAX, mn.KL_K3, mn.PHANTOM_FRAC)


def _run(model: str, task: str, prompts: int, group: int, tokens: int, recipe: str,
         steps: int) -> list[dict]:
    from parity.config import make_config
    from parity.trainer import train
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"recipe": recipe, "task": task, "model": model, "steps": steps,
                           "prompts_per_step": prompts, "samples_per_prompt": group,
                           "max_new_tokens": tokens, "lr": 1e-6, "out": f"{tmp}/run",
                           "progress": False})
        run = train(cfg)
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]


def run_steps(*args) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_run, *args).result()


def table(a: argparse.Namespace) -> Table:
    t = Table("zero_mismatch",
              f"a training step by recipe, mean of {a.steps - 1} steps after the first over "
              f"{a.rounds} alternating runs of each, each run in a fresh process",
              [("model", None), ("recipe", None), ("rollout s", "{:.2f}"),
               ("train s", "{:.2f}"), ("step s", "{:.2f}"),
               ("step / bf16-shadow's", "{:.2f}x"), ("max |beta|", "{:.3g}"),
               ("kl_k3", "{:.3g}"), ("phantom_frac", "{:.3g}")])
    from parity import testbed
    for model, task, prompts, group, tokens in MODELS:
        testbed.ensure(model)   # built or converted once, before anything is timed
        rows: dict[str, list[dict]] = {r: [] for r in RECIPES}
        for _ in range(a.rounds):
            for recipe in RECIPES:
                rows[recipe] += run_steps(model, task, prompts, group, tokens, recipe, a.steps)
        mean = {r: {k: statistics.mean(x[k] for x in rows[r]) for k in
                    ("time/rollout_s", "time/train_s", "time/step_s")} for r in RECIPES}
        shadow = mean["bf16-shadow"]["time/step_s"]
        for r in RECIPES:
            m = mean[r]
            gap = [max(x.get(k, 0.0) for x in rows[r]) for k in GAP]
            t.add(f"{model} ({prompts}x{group}, {tokens} tokens)", r, m["time/rollout_s"],
                  m["time/train_s"], m["time/step_s"], m["time/step_s"] / shadow, *gap)
    t.notes.append("max |beta|, kl_k3 and phantom_frac: the largest over the timed steps; "
                   "bitwise's are exactly 0 where its kernels hold")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = json_option(ap, "zero_mismatch").parse_args()
    publish("zero_mismatch", [table(a)], a)


if __name__ == "__main__":
    main()
