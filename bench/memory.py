"""Peak memory and update time of a training step against its shape, unbatched and with the
memory settings (micro-batches, chunked log-probs, gradient checkpointing).

    python -m bench.memory                                     # testbed `text`, a small grid
    python -m bench.memory --model smollm2-135m --completions 16 --tokens 64,256,1024 \\
        --modes whole,micro4 --recipe bf16-engine --chat-template

Each cell is its own process running `--steps` steps of neg-length (the task that makes
completions as long as the model likes), so its peak resident memory (ru_maxrss) is that
step's alone, model loading included. Modes:
    whole        one forward and backward over the step's completions (the defaults: log-probs
                 a chunk of tokens at a time, parity/logprobs/scoring.py)
    microN       micro_batch=N
    microN+      micro_batch=N, gradient checkpointing
The estimate is what `parity train` checks before it starts (parity/runs/memory.py, worst case:
every completion at max tokens). Update time is `time/train_s` of the last step (forward,
backward, optimizer step; the rollout is not in it). Cells run one after another in the order
given; quote ratios between cells of one run, absolute times drift on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import ROOT, Table, json_option, publish


def _mode(name: str) -> dict:
    if name == "whole":
        return {}
    if not name.startswith("micro"):
        raise SystemExit(f"unknown mode {name!r}: whole, microN or microN+")
    plus = name.endswith("+")
    out = {"micro_batch": int(name[5:].rstrip("+"))}
    if plus:
        out |= {"gradient_checkpointing": True}
    return out


def worker(a: argparse.Namespace) -> dict:
    from parity.config import make_config
    from parity.reports import load_metrics
    from parity.trainer import train
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"task": "neg-length", "recipe": a.recipe, "model": a.model,
                           "steps": a.steps, "prompts_per_step": a.completions // a.group,
                           "samples_per_prompt": a.group, "max_new_tokens": a.tokens,
                           "lr": a.lr, "seed": a.seed, "chat_template": a.chat_template,
                           "out": str(Path(tmp) / "run"), "progress": False, "save_every": 0,
                           "report_to": "none", **_mode(a.mode)})
        captured = []
        rows = load_metrics(train(cfg, on_model=captured.append) / "metrics.jsonl")
    from transformers import AutoTokenizer

    from parity import testbed
    from parity.runs import memory
    from parity.tasks import prompt_token_ids
    from parity.tasks.data import text_prompts
    tok = AutoTokenizer.from_pretrained(testbed.resolve_model(a.model))
    longest = max(len(prompt_token_ids(tok, p, a.chat_template))
                  for p in text_prompts(256, seed=a.seed))
    est = memory.estimate(cfg, captured[0], longest).total
    last = rows[-1]
    return {"peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "estimate_gb": est / 2 ** 30,
            "update_s": last["time/train_s"], "len_mean": last["completion/len_mean"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="text")
    ap.add_argument("--recipe", default="fp32")
    ap.add_argument("--completions", default="16,64", help="completions per step, comma-separated")
    ap.add_argument("--tokens", default="32,128", help="max tokens per completion, comma-separated")
    ap.add_argument("--modes", default="whole,micro8,micro8+")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="whole", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = json_option(ap, "memory").parse_args()
    if a.worker:
        a.completions, a.tokens = int(a.completions), int(a.tokens)
        Path(a.result).write_text(json.dumps(worker(a)))
        return

    from parity import testbed
    testbed.ensure(a.model)  # built or converted once, before any measured cell
    t = Table("memory", f"model {a.model}, recipe {a.recipe}, neg-length, {a.steps} step(s) per "
                        f"cell, {'chat-templated' if a.chat_template else 'plain'} prompts",
              [("completions", "{}"), ("max tokens", "{}"), ("mean tokens", "{:.0f}"),
               ("mode", None), ("peak GB", "{:.2f}", "right"), ("estimate GB", "{:.2f}"),
               ("update s", "{:.2f}")])
    for n in map(int, a.completions.split(",")):
        for tokens in map(int, a.tokens.split(",")):
            for mode in a.modes.split(","):
                with tempfile.TemporaryDirectory() as tmp:
                    res = Path(tmp) / "r.json"
                    # -m from the repository's root: the worker imports `bench` as this does
                    cmd = [sys.executable, "-m", "bench.memory", "--worker", "--mode", mode,
                           "--result", str(res), "--model", a.model, "--recipe", a.recipe,
                           "--completions", str(n), "--tokens", str(tokens), "--group",
                           str(a.group), "--steps", str(a.steps), "--lr", str(a.lr), "--seed",
                           str(a.seed)]
                    cmd += ["--chat-template"] if a.chat_template else []
                    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    # a cell that failed is reported as failed, not as a number
                    if p.returncode != 0:
                        why = (p.stderr.strip().splitlines() or ["?"])[-1][:80]
                        t.add(n, tokens, None, mode, f"failed: {why}", None, None)
                        print(f"{n} x {tokens}, {mode}: failed: {why}", flush=True)
                        continue
                    r = json.loads(res.read_text())
                t.add(n, tokens, r["len_mean"], mode, r["peak_gb"], r["estimate_gb"],
                      r["update_s"])
                print(f"{n} x {tokens}, {mode}: peak {r['peak_gb']:.2f} GB", flush=True)
    publish("memory", [t], a)

if __name__ == "__main__":
    main()
