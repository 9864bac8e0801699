"""Step-time table: rollout / train split and tokens/s per model and recipe.

    python bench/step_time.py [--steps 6] [--models text-xs,LARGEST] [--recipes fp32,bf16-engine,fp16]

Runs `neg-length` GRPO steps (8 prompts x 8 samples, 24 new tokens) through the real trainer,
drops the first step (warm-up) and prints the mean of the rest. Compare rows of one run: absolute
times drift on shared machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import testbed  # noqa: E402
from parity.config import make_config  # noqa: E402
from parity.trainer import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default=f"{testbed.TEST_TEXT},{testbed.LARGEST}")
    ap.add_argument("--recipes", default="fp32,bf16-engine,fp16")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    t = Table(title=f"parity step time, neg-length, 8x8 completions, <= {args.max_new_tokens} "
                    f"tokens, mean of steps 2..{args.steps}")
    for col in ("model", "params", "recipe", "rollout s", "train s", "step s", "train share",
                "tokens/s"):
        t.add_column(col, justify="right" if col not in ("model", "recipe") else "left")
    for model in args.models.split(","):
        path = testbed.ensure(model)
        n_params = json.loads((path / "testbed.json").read_text()).get("n_params", "")
        for recipe in args.recipes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = make_config({"recipe": recipe, "task": "neg-length", "model": model,
                                   "steps": args.steps, "max_new_tokens": args.max_new_tokens,
                                   "lr": 1e-6, "out": f"{tmp}/run", "progress": False})
                run = train(cfg)
                rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rows = rows[1:] or rows
            mean = {k: statistics.mean(r[k] for r in rows) for k in
                    ("time/rollout_s", "time/train_s", "time/step_s", "throughput/tokens_per_s")}
            t.add_row(model, f"{n_params / 1e6:.1f}M" if n_params else "", recipe,
                      f"{mean['time/rollout_s']:.3f}", f"{mean['time/train_s']:.3f}",
                      f"{mean['time/step_s']:.3f}",
                      f"{mean['time/train_s'] / mean['time/step_s']:.0%}",
                      f"{mean['throughput/tokens_per_s']:.0f}")
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
