"""A training step's time by stage for each engine, side by side: rollout, weight sync, update.

    python -m bench.engine_step                                  # smollm2-135m, 64 x <= 64 tokens
    python -m bench.engine_step --tokens 64,256 --steps 3 \\
        --json docs/data/bench/engine_step-256.json

Each run is `parity train` in its own process (fp32 trainer, bf16 engine, `neg-length` on text
prompts, which an instruct model answers at length, lr 1e-6 so the length does not move); runs
alternate between the engines so drift on a shared machine hits both. Per run the medians over
the steps after the first (vLLM's start and the first load sit in step 1): `sync_s` (the cast to
engine precision, and vLLM's reload), `rollout_s` (sampling and rewards, sync excluded), the
completion tokens sampled per second of it, `update_s` (`time/train_s`: ℓ_π, the shadow, the
loss, backward, AdamW) and the mean completion length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import Table, json_option, publish


def one_run(engine: str, tokens: int, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "parity", "train", "--model", a.model, "--task",
               "neg-length", "--engine", engine, "--recipe", "bf16-engine", "--steps",
               str(a.steps), "--prompts-per-step", str(a.prompts), "--samples-per-prompt",
               str(a.group), "--max-new-tokens", str(tokens), "--lr", "1e-6", "--no-progress",
               "--report-to", "none", "--save-every", "0", "--kl-exact-rows", "0",
               "--micro-batch", str(a.micro_batch), "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:] or rows
    med = lambda k: statistics.median(m[k] for m in rows)
    n = a.prompts * a.group
    rollout = med("time/rollout_s") - med("time/sync_s")
    return {"engine": engine, "tokens": tokens, "sync_s": med("time/sync_s"),
            "rollout_s": rollout, "update_s": med("time/train_s"),
            "step_s": med("time/step_s"), "len_mean": med("completion/len_mean"),
            "rollout_tokens_s": med("completion/len_mean") * n / rollout}


def table(rows: list[dict], model: str, prompts: int, group: int, steps: int) -> Table:
    t = Table("engine_step", f"{model}: {prompts} x {group} completions, bf16 engine, fp32 "
                             f"trainer, medians over steps 2-{steps}",
              [("engine", None), ("max tokens", "{}"), ("mean length", "{:.1f}"),
               ("sync s", "{:.2f}"), ("rollout s", "{:.2f}"), ("rollout tok/s", "{:.0f}"),
               ("update s", "{:.2f}"), ("step s", "{:.2f}")])
    for r in rows:
        t.add(r["engine"], r["tokens"], r["len_mean"], r["sync_s"], r["rollout_s"],
              r["rollout_tokens_s"], r["update_s"], r["step_s"])
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--tokens", default="64", help="max new tokens, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=0, help="completions per trainer "
                    "forward (0: the whole minibatch); 64 completions of 256 tokens on "
                    "SmolLM2 need 8 on a 24 GB machine")
    a = json_option(ap, "engine_step").parse_args()
    rows = []
    for tokens in map(int, a.tokens.split(",")):
        for engine in a.engines.split(","):
            print(f"{engine}, <= {tokens} tokens ...", flush=True)
            rows.append(one_run(engine, tokens, a))
    publish("engine_step", [table(rows, a.model, a.prompts, a.group, a.steps)], a)

if __name__ == "__main__":
    main()
