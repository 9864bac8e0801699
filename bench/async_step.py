"""Asynchronous rollouts: is a step as long as the slower of sampling and training?

    python -m bench.async_step [--model LARGEST] [--steps 8] [--staleness 1,2] [--engines hf,vllm]

Runs `neg-length` GRPO through the real trainer, synchronously and with the engine in its own
process (`--async-engine --max-staleness m`), on the same seed, and prints the mean over steps
2..N (step 1 starts the engine process). In async mode `rollout s` is the engine process's time
on a rollout and `train s` the trainer's time on a step, both measured while the other runs; the
step is the time between two steps' ends. A perfect overlap makes it max(rollout, train): the
last column is step / max, and the target is <= 1.10. Compare rows of one run: absolute times
drift on shared machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from bench.report import Table, engines_option, json_option, publish
from parity import testbed
from parity.config import make_config
from parity.trainer import train


def run(model: str, steps: int, tokens: int, recipe: str, **extra) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"recipe": recipe, "task": "neg-length", "model": model,
                           "steps": steps, "max_new_tokens": tokens, "lr": 1e-5,
                           "out": f"{tmp}/run", "progress": False, "report_to": "none",
                           **extra})
        path = train(cfg)
        return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--recipe", default="bf16-engine")
    ap.add_argument("--staleness", default="1,2")
    a = json_option(engines_option(ap), "async_step").parse_args()
    testbed.ensure(a.model)
    t = Table("async_step", f"{a.model}, neg-length, 8x8 completions, <= {a.max_new_tokens} "
                            f"tokens, {a.recipe}, mean of steps 2..{a.steps}",
              [("engine", None), ("mode", None), ("threads trainer+engine", None, "right"),
               ("rollout s", "{:.3f}"), ("train s", "{:.3f}"), ("step s", "{:.3f}"),
               ("max(rollout, train)", "{:.3f}"), ("step / max", "{:.3f}"),
               ("staleness max", "{}"), ("step vs sync", "{:.2f}x")])
    cores = torch.get_num_threads()
    modes = [("sync", {})] + [(f"async, max_staleness {m}",
                               {"async_engine": True, "max_staleness": int(m)})
                              for m in a.staleness.split(",")]
    if cores > 1:  # the cores split between the two sides instead
        modes.append((f"async, max_staleness {a.staleness.split(',')[0]}, cores split",
                      {"async_engine": True, "max_staleness": int(a.staleness.split(",")[0]),
                       "threads": cores - cores // 2, "engine_threads": cores // 2}))
    for engine in a.engines:
        sync_step = None    # the first mode, each engine's own
        for name, extra in modes:
            rows = run(a.model, a.steps, a.max_new_tokens, a.recipe, engine=engine, **extra)
            mean = {k: statistics.mean(r[k] for r in rows)
                    for k in ("time/rollout_s", "time/train_s", "time/step_s")}
            bound = max(mean["time/rollout_s"], mean["time/train_s"])
            sync_step = sync_step or mean["time/step_s"]
            threads = (f"{cores} (in turn)" if not extra else
                       f"{extra.get('threads') or cores}+{extra.get('engine_threads') or 1}")
            t.add(engine, name, threads, mean["time/rollout_s"], mean["time/train_s"],
                  mean["time/step_s"], bound if extra else None,
                  mean["time/step_s"] / bound if extra else None,
                  max(r.get("async/staleness", 0) for r in rows),
                  mean["time/step_s"] / sync_step)
    publish("async_step", [t], a)

if __name__ == "__main__":
    main()
