"""parity against TRL's GRPOTrainer on the same workload, side by side, on the CPU or a GPU.

    python -m bench.vs_trl                       # arith model and task, 16 prompts x 8, 8 tokens
    python -m bench.vs_trl --steps 40 --repeats 3
    python -m bench.vs_trl --engines hf,vllm     # parity with its own engine and with vLLM
    python -m bench.vs_trl --model text --task neg-length --max-new-tokens 24
    python -m bench.vs_trl --model smollm2-135m --task neg-length --prompts 8 --max-new-tokens 64 \
        --lr 1e-6 --steps 4 --repeats 1 --micro-batch 8
    python -m bench.vs_trl --device cuda --model smollm2-135m --task neg-length --max-new-tokens 128

Both sides train the same testbed model on the same task rows with the same reward function
(`arith`: the problems the model solves 20-80% of the time; `neg-length`: text prompts), with
the same prompts per step x completions per prompt, completion length, learning rate,
optimizer (AdamW, constant rate, no weight decay, gradient clip 1.0), GRPO loss (per-sequence
mean, group-normalised advantages, clip 0.2, no KL term), precision (fp32 on both sides:
GRPOConfig(bf16=False), parity's `fp32` recipe) and one optimizer step per generation. TRL runs
without vLLM (`use_cpu=True`) and, to its advantage, without gradient checkpointing (its
default), which only costs time on a model this size.

Each run is its own process; runs alternate (TRL, parity, TRL, ...) so drift on a shared
machine hits both. Step time is the median over the steps after the first two (warm-up): for
TRL the wall time between consecutive `on_step_end` callbacks, for parity `time/step_s` (rollout
plus update). The table gives step time, completions/s, completion tokens/s, their ratio, and
the mean reward over the first and the last five steps, so "as fast" is judged at similar
learning. The update alone is each side's step minus its generation (TRL: the time inside
`_generate_and_score_completions`, which also computes rewards and advantages; parity:
`time/train_s`). The last line bounds what any engine could achieve: parity's update alone
(forward with grad, backward, AdamW over the same tokens, which TRL must do too) against TRL's
step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import Table, json_option, publish


def _peak_gb(device: str) -> float:
    """The process's peak memory on the side's device: the GPU's allocator, or resident RAM."""
    if device == "cuda":
        import torch
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def trl_worker(a: argparse.Namespace, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from parity import testbed
    from parity.tasks import build_task
    model_dir = testbed.ensure(a.model, progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    task = build_task(a.task, None, model_dir, model, tok, a.max_new_tokens, None, a.seed, 1.0,
                      solve_rates=testbed.solve_rates)
    ds = datasets.Dataset.from_list(task.rows)
    reward = task.reward_fns[0].fn  # the very function parity calls, TRL's signature
    stamps: list[float] = []
    gen = [0.0]            # seconds spent sampling and scoring completions so far
    gen_at_step: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            gen_at_step.append(gen[0])

    args = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=a.device == "cpu", bf16=False, fp16=False,
        gradient_checkpointing=False, max_steps=a.steps, learning_rate=a.lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=a.micro_batch or a.prompts * a.group,
        gradient_accumulation_steps=(a.prompts * a.group) // (a.micro_batch or a.prompts * a.group),
        num_generations=a.group,
        max_completion_length=a.max_new_tokens, temperature=1.0, epsilon=0.2, beta=0.0,
        loss_type="grpo", scale_rewards="group", logging_steps=1, save_strategy="no",
        report_to=[], seed=a.seed, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward,
                          args=args, train_dataset=ds, callbacks=[Clock()])
    # TRL's update alone: the step minus its generation (sampling, rewards, advantages, and
    # the old log-probs TRL computes there), the same split as parity's time/train_s.
    generate = trainer._generate_and_score_completions

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return generate(*args, **kw)
        finally:
            gen[0] += time.perf_counter() - t
    trainer._generate_and_score_completions = timed
    start = time.perf_counter()
    trainer.train()
    steps = [h for h in trainer.state.log_history if "reward" in h]
    times = [b - a_ for a_, b in zip([start] + stamps[:-1], stamps)]
    gens = [b - a_ for a_, b in zip([0.0] + gen_at_step[:-1], gen_at_step)]
    return {"step_s": times, "update_s": [t - g for t, g in zip(times, gens)],
            "reward": [h["reward"] for h in steps],
            "tokens": [h["completions/mean_length"] * a.prompts * a.group for h in steps],
            "peak_gb": _peak_gb(a.device)}


def parity_worker(a: argparse.Namespace, out: Path) -> dict:
    from parity.config import make_config
    from parity.reports import load_metrics
    from parity.trainer import train
    cfg = make_config({"task": a.task, "recipe": "fp32", "model": a.model, "steps": a.steps,
                       "lr": a.lr, "prompts_per_step": a.prompts, "samples_per_prompt": a.group,
                       "max_new_tokens": a.max_new_tokens, "seed": a.seed, "optimizer": "adamw",
                       "weight_decay": 0.0, "max_grad_norm": 1.0, "loss_agg": "seq-mean",
                       "out": str(out / "parity"), "progress": False, "save_every": 0,
                       "report_to": "none", "micro_batch": a.micro_batch,
                       "device": a.device, "engine": a.engine})
    rows = load_metrics(train(cfg) / "metrics.jsonl")
    return {"step_s": [m["time/step_s"] for m in rows], "reward": [m["reward/mean"] for m in rows],
            "tokens": [m["completion/len_mean"] * a.prompts * a.group for m in rows],
            "update_s": [m["time/train_s"] for m in rows],
            "peak_gb": _peak_gb(a.device)}


def run_worker(side: str, a: argparse.Namespace) -> dict:
    """`side`: trl, or parity-ENGINE."""
    who, _, engine = side.partition("-")
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", who, "--result", str(res),
               f"--engine={engine or 'hf'}",
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                 if k not in ("worker", "result", "repeats", "engines", "engine"))]
        subprocess.run(cmd, check=True)
        return json.loads(res.read_text())


def summarize(r: dict, a: argparse.Namespace) -> dict:
    warm = r["step_s"][2:] or r["step_s"]
    step = statistics.median(warm)
    tok = statistics.median(r["tokens"][2:] or r["tokens"])
    out = {"step_s": step, "completions_s": a.prompts * a.group / step, "tokens_s": tok / step,
           "reward_first5": statistics.mean(r["reward"][:5]),
           "reward_last5": statistics.mean(r["reward"][-5:]), "peak_gb": r["peak_gb"]}
    if "update_s" in r:
        out["update_s"] = statistics.median(r["update_s"][2:] or r["update_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="arith")
    ap.add_argument("--task", default="arith", choices=("arith", "neg-length"))
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=0, help="completions per forward and "
                    "backward on both sides (TRL: per-device batch with gradient accumulation; "
                    "parity: micro_batch); 0: the whole step at once")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both sides on the "
                    "CPU, or both on the GPU (TRL: use_cpu=False, its own generation, no vLLM)")
    ap.add_argument("--engines", default="hf", help="parity's engines, comma-separated: one "
                    "parity side each (hf, vllm), all against the same TRL runs")
    ap.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=("trl", "parity"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = json_option(ap, "vs_trl").parse_args()
    if a.worker:
        fn = trl_worker if a.worker == "trl" else parity_worker
        with tempfile.TemporaryDirectory() as tmp:
            Path(a.result).write_text(json.dumps(fn(a, Path(tmp))))
        return

    from parity import testbed
    testbed.ensure(a.model)  # built once, before any timed run
    sides = ["trl"] + [f"parity-{e}" for e in a.engines.split(",")]
    results: dict[str, list[dict]] = {w: [] for w in sides}
    for i in range(a.repeats):
        for who in (sides if i % 2 == 0 else sides[::-1]):
            print(f"run {i + 1}/{a.repeats}: {who} ...", flush=True)
            results[who].append(summarize(run_worker(who, a), a))

    cols = ("step_s", "completions_s", "tokens_s", "reward_first5", "reward_last5", "peak_gb")
    med = {w: {c: statistics.median(r[c] for r in rs) for c in cols} for w, rs in results.items()}
    # The update (forward with grad, backward, AdamW over the same tokens) is work TRL must do
    # too: even a free engine cannot make parity faster than TRL's step over it.
    upd = {w: statistics.median(r["update_s"] for r in rs) for w, rs in results.items()}
    t = Table("vs_trl", f"workload: {a.model} on {a.task} ({a.device}), {a.prompts} prompts x "
                        f"{a.group} completions, <= {a.max_new_tokens} tokens, {a.steps} steps, "
                        f"fp32, one process each, "
                        f"{f'micro-batches of {a.micro_batch}, ' if a.micro_batch else ''}"
                        f"{a.repeats} alternating runs per side (medians over runs)",
              [("side", None)] + [(c, "{:.4g}") for c in cols]
              + [("update alone s", "{:.4g}"), ("update alone ÷ TRL", "{:.2f}"),
                 ("completions/s ÷ TRL", "{:.2f}x"),
                 ("tokens/s ÷ TRL", "{:.2f}x"), ("TRL step ÷ update alone", "{:.2f}x")])
    for w in sides:
        trl = w == "trl"
        t.add(w, *(med[w][c] for c in cols), upd[w], None if trl else upd[w] / upd["trl"],
              None if trl else med[w]["completions_s"] / med["trl"]["completions_s"],
              None if trl else med[w]["tokens_s"] / med["trl"]["tokens_s"],
              None if trl else med["trl"]["step_s"] / upd[w])
    t.notes += [f"{w} runs: " + ", ".join(f"{r['step_s']:.3f} s/step" for r in rs)
                for w, rs in results.items()]
    t.notes.append("update alone: the step minus the generation; TRL's step ÷ parity's update "
                   "alone is the most any engine could give against TRL's step")
    publish("vs_trl", [t], a)

if __name__ == "__main__":
    main()
