"""TRL's GRPOTrainer with parity's engine, ratio sources and diagnostics, on a testbed model.

    python examples/trl_grpo.py --recipe bf16-engine --eps 0.01
    python examples/trl_grpo.py --recipe bf16-shadow --eps 0.01
    python examples/trl_grpo.py --recipe fp16
    python examples/trl_grpo.py --recipe bf16-shadow --eps 0.01 --iterations 2
    python examples/trl_grpo.py --recipe bf16-shadow --device cuda
    python examples/trl_grpo.py --recipe bf16-engine --eps 0.01 --use-vllm

Prints, per step, TRL's own clip count next to parity's attribution of it.
"""

from __future__ import annotations

import argparse
import dataclasses

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from parity import testbed
from parity.config import TASK_DEFAULTS
from parity.integrations.trl import ParityGRPOTrainer, ParityOptions
from parity.tasks.data import text_prompts

# The testbed's neg-length task, on its own model, lr and completion length.
TASK = TASK_DEFAULTS["neg-length"]
EPSILON = next(f.default for f in dataclasses.fields(GRPOConfig) if f.name == "epsilon")


def neg_length(prompts, completions, completion_ids, **_):
    """neg-length, the testbed's sanity task: the shortest completion wins."""
    return [-float(len(c)) for c in completion_ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TASK["model"], help="testbed model or HF model directory")
    ap.add_argument("--recipe", default="bf16-engine")
    ap.add_argument("--eps", type=float, default=EPSILON, help="GRPOConfig.epsilon")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=TASK["lr"])
    ap.add_argument("--batch", type=int, default=32, help="completions per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=TASK["max_new_tokens"],
                    help="max_completion_length")
    ap.add_argument("--iterations", type=int, default=1,
                    help="GRPOConfig.num_iterations: updates per batch of completions")
    ap.add_argument("--shadow-kernels", default="engine",
                    choices=("engine", "independent", "scored"),
                    help="the shadow's attention: the engine's, or the trainer's own; scored: "
                         "vLLM scores it (--use-vllm)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="TRL's accelerator (use_cpu), which parity's engine and shadow follow")
    ap.add_argument("--use-vllm", action="store_true",
                    help="TRL's own vLLM samples, in this process (GRPOConfig(use_vllm=True, "
                         "vllm_mode='colocate')), instead of parity's engine")
    ap.add_argument("--out", default="runs/trl-example")
    a = ap.parse_args()

    model_dir = testbed.resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.Dataset.from_list([{"prompt": p} for p in text_prompts(256)])
    # TRL's precision and importance-correction defaults stay: parity sets them to the recipe's
    # and prints one line for each it changed (docs/trl.md)
    args = GRPOConfig(output_dir=a.out, use_cpu=a.device == "cpu", max_steps=a.steps,
                      learning_rate=a.lr,
                      per_device_train_batch_size=a.batch, num_generations=a.group,
                      max_completion_length=a.max_tokens, num_iterations=a.iterations,
                      epsilon=a.eps, logging_steps=1, gradient_checkpointing=a.recipe != "fp16",
                      save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                      use_vllm=a.use_vllm, vllm_mode="colocate")
    trainer = ParityGRPOTrainer(model=model, processing_class=tok, reward_funcs=neg_length,
                                args=args, train_dataset=dataset,
                                parity=ParityOptions.from_recipe(a.recipe,
                                                                 shadow_kernels=a.shadow_kernels))
    trainer.train()

    cols = ("reward", "clip_ratio/region_mean", "clip/phantom_frac", "clip/alpha_frac",
            "mismatch/kernel_gap_abs_mean", "mismatch/beta_abs_mean", "mismatch/kl_k3")
    print("\nstep  " + "  ".join(f"{c:>22}" for c in cols))
    for h in trainer.state.log_history:  # an update on reused completions logs no reward
        if "clip/frac" in h:
            print(f"{h['step']:>4}  " + "  ".join(f"{h.get(c, float('nan')):>22.4g}" for c in cols))


if __name__ == "__main__":
    main()
