"""A short ParityGRPOTrainer run whose log `scripts/same_metrics.py` can compare, so that a change
meant to leave the TRL integration alone is checked bit for bit like `parity train`:

    python scripts/trl_run.py MODEL_DIR OUT [--recipe bf16-shadow] [--steps 3]

Trains MODEL_DIR (a testbed model: `parity testbed`) for a few steps on the length task with
TRL's GRPOTrainer and parity's options, on the CPU, and writes TRL's per-step log to
OUT/metrics.jsonl, one line per step with its `step`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def neg_length(prompts, completions, completion_ids, **_):
    return [-float(len(c)) for c in completion_ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--recipe", default="bf16-shadow")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity.integrations.trl import ParityGRPOTrainer, ParityOptions
    try:
        from parity.tasks.data import text_prompts
    except ImportError:  # parity before its packages, to compare a run from before them
        from parity.testbed import text_prompts

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": x} for x in text_prompts(64)])
    cfg = GRPOConfig(output_dir=str(args.out / "trl"), use_cpu=True, bf16=False,
                     per_device_train_batch_size=16, num_generations=4,
                     max_completion_length=16, max_steps=args.steps, logging_steps=1,
                     report_to=[], learning_rate=1e-4, save_strategy="no", seed=0,
                     epsilon=0.2, disable_tqdm=True)
    t = ParityGRPOTrainer(model=model, processing_class=tok, reward_funcs=neg_length, args=cfg,
                          train_dataset=ds, parity=ParityOptions.from_recipe(args.recipe))
    t.train()
    rows = [h for h in t.state.log_history if "reward" in h]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} steps -> {args.out / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
