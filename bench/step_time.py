"""Step-time table: rollout / train split and tokens/s per model and recipe.

    python -m bench.step_time [--steps 6] [--models text-xs,LARGEST] \\
        [--recipes fp32,bf16-engine,fp16] [--engines hf,vllm]

Runs `neg-length` GRPO steps (8 prompts x 8 samples, 24 new tokens) through the real trainer,
drops the first step (warm-up) and prints the mean of the rest. Compare rows of one run: absolute
times drift on shared machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from bench.report import Table, engines_option, json_option, publish
from parity import testbed
from parity.config import make_config
from parity.trainer import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default=f"{testbed.TEST_TEXT},{testbed.LARGEST}")
    ap.add_argument("--recipes", default="fp32,bf16-engine,fp16")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = json_option(engines_option(ap), "step_time").parse_args()
    t = Table("step_time", f"parity step time, neg-length, 8x8 completions, <= "
                           f"{args.max_new_tokens} tokens, mean of steps 2..{args.steps}",
              [("model", None), ("params", "{:.1f}M"), ("engine", None), ("recipe", None),
               ("rollout s", "{:.3f}"), ("train s", "{:.3f}"), ("step s", "{:.3f}"),
               ("train share", "{:.0%}"),
               ("tokens/s", "{:.0f}")])
    for model in args.models.split(","):
        path = testbed.ensure(model)
        n_params = json.loads((path / "testbed.json").read_text()).get("n_params")
        for engine, recipe in [(e, r) for e in args.engines for r in args.recipes.split(",")]:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = make_config({"recipe": recipe, "task": "neg-length", "model": model,
                                   "engine": engine,
                                   "steps": args.steps, "max_new_tokens": args.max_new_tokens,
                                   "lr": 1e-6, "out": f"{tmp}/run", "progress": False})
                run = train(cfg)
                rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rows = rows[1:] or rows
            mean = {k: statistics.mean(r[k] for r in rows) for k in
                    ("time/rollout_s", "time/train_s", "time/step_s", "throughput/tokens_per_s")}
            t.add(model, n_params / 1e6 if n_params else None, engine, recipe,
                  mean["time/rollout_s"], mean["time/train_s"], mean["time/step_s"],
                  mean["time/train_s"] / mean["time/step_s"], mean["throughput/tokens_per_s"])
    publish("step_time", [t], args)

if __name__ == "__main__":
    main()
