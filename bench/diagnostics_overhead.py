"""Cost of the diagnostics on every update: the same GRPO steps with and without the shadow forward.

    python bench/diagnostics_overhead.py [--model LARGEST] [--recipes bf16-engine,fp16] [--steps 6] [--rounds 2]

`neg-length` on the largest testbed model, 8 prompts x 8 samples, <= 24 new tokens, one update
per step. Runs alternate (off, on, off, on, ...) so drift on a shared machine hits both alike;
the first step of each run is dropped (warm-up). The overhead is the extra step time with
diagnostics on, as a share of the step time with them off.
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


def steps(model: str, recipe: str, diagnostics: bool, n: int, new_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"recipe": recipe, "task": "neg-length", "model": model, "steps": n,
                           "max_new_tokens": new_tokens, "lr": 1e-6, "out": f"{tmp}/run",
                           "progress": False, "diagnostics": diagnostics})
        run = train(cfg)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return rows[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--recipes", default="bf16-engine,fp16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    path = testbed.ensure(args.model)
    n_params = json.loads((path / "testbed.json").read_text()).get("n_params", 0)
    t = Table(title=f"diagnostics overhead: {args.model} ({n_params / 1e6:.1f}M), neg-length "
                    f"8x8, <= {args.max_new_tokens} tokens, {args.rounds} alternating rounds of "
                    f"{args.steps - 1} timed steps")
    for col in ("recipe", "diagnostics", "rollout s", "train s", "step s", "overhead of step",
                "overhead of train"):
        t.add_column(col, justify="left" if col in ("recipe", "diagnostics") else "right")
    for recipe in args.recipes.split(","):
        rows: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for diag in (False, True):
                rows[diag] += steps(args.model, recipe, diag, args.steps, args.max_new_tokens)
        mean = {d: {k: statistics.mean(r[k] for r in rows[d])
                    for k in ("time/rollout_s", "time/train_s", "time/step_s")} for d in rows}
        # The rollouts differ in length between runs only through sampling noise; compare the
        # train phase, where the shadow forward runs, and the whole step.
        for d in (False, True):
            m = mean[d]
            t.add_row(recipe, "on" if d else "off", f"{m['time/rollout_s']:.3f}",
                      f"{m['time/train_s']:.3f}", f"{m['time/step_s']:.3f}",
                      "" if not d else
                      f"{(m['time/step_s'] - mean[False]['time/step_s']) / mean[False]['time/step_s']:+.1%}",
                      "" if not d else
                      f"{(m['time/train_s'] - mean[False]['time/train_s']) / mean[False]['time/train_s']:+.1%}")
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
