"""Cost of the diagnostics per update: the same GRPO steps with and without the shadow forward.

    python -m bench.diagnostics_overhead [--model LARGEST] [--recipes bf16-engine,fp16] \\
        [--steps 6] [--rounds 2] [--engines hf,vllm]

`neg-length` on the largest testbed model, 8 prompts x 8 samples, <= 24 new tokens, one update
per step. Runs alternate (off, on, off, on, ...) so drift on a shared machine hits both alike;
the first step of each run is dropped (warm-up). The overhead is the extra step time with
diagnostics on, as a share of the step time with them off.
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


def steps(model: str, engine: str, recipe: str, diagnostics: bool, n: int, new_tokens: int
          ) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"recipe": recipe, "task": "neg-length", "model": model, "steps": n,
                           "engine": engine,
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
    args = json_option(engines_option(ap), "diagnostics_overhead").parse_args()
    path = testbed.ensure(args.model)
    n_params = json.loads((path / "testbed.json").read_text()).get("n_params", 0)
    t = Table("diagnostics_overhead",
              f"diagnostics overhead: {args.model} ({n_params / 1e6:.1f}M), neg-length 8x8, <= "
              f"{args.max_new_tokens} tokens, {args.rounds} alternating rounds of "
              f"{args.steps - 1} timed steps",
              [("engine", None), ("recipe", None), ("diagnostics", None), ("rollout s", "{:.3f}"),
               ("train s", "{:.3f}"), ("step s", "{:.3f}"), ("overhead of step", "{:+.1%}"),
               ("overhead of train", "{:+.1%}")])
    for engine, recipe in [(e, r) for e in args.engines for r in args.recipes.split(",")]:
        rows: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for diag in (False, True):
                rows[diag] += steps(args.model, engine, recipe, diag, args.steps,
                                    args.max_new_tokens)
        mean = {d: {k: statistics.mean(r[k] for r in rows[d])
                    for k in ("time/rollout_s", "time/train_s", "time/step_s")} for d in rows}
        # The rollouts differ in length between runs only through sampling noise; compare the
        # train phase, where the shadow forward runs, and the whole step.
        off = mean[False]
        for d in (False, True):
            m = mean[d]
            t.add(engine, recipe, "on" if d else "off", m["time/rollout_s"], m["time/train_s"],
                  m["time/step_s"],
                  (m["time/step_s"] - off["time/step_s"]) / off["time/step_s"] if d else None,
                  (m["time/train_s"] - off["time/train_s"]) / off["time/train_s"] if d else None)
    publish("diagnostics_overhead", [t], args)

if __name__ == "__main__":
    main()
