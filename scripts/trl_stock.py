"""parity's GRPOTrainer as a TRL user runs it: TRL's stock GRPOConfig (bf16, gradient
checkpointing), SmolLM2-135M with its tied embeddings, an fp32 LM head, min-p and a repetition
penalty, and TRL's own colocated vLLM; two steps, parity's figures printed per step.

    python scripts/trl_stock.py [--steps 2]

Needs trl, vLLM's CPU build and the SmolLM2 wheel (README.md). `use_cpu=True` is transformers'
own requirement on a machine without a GPU; TRL's importance correction is off because parity
refuses it beside the engine's log-probs in the ratio (docs/trl.md).
"""

from __future__ import annotations

import argparse
import json


def short(completions, **_):
    return [-float(len(c[0]["content"])) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="trl-stock")
    a = p.parse_args()
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from parity import testbed
    from parity.integrations.trl import ParityGRPOTrainer, ParityOptions
    from parity.tasks.data import chat_questions
    model_dir = str(testbed.resolve_model("smollm2-135m"))
    args = GRPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=24, logging_steps=1,
                      report_to=[], save_strategy="no", use_cpu=True,
                      cast_lm_head_to_fp32=True, min_p=0.05, repetition_penalty=1.1,
                      use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                      vllm_importance_sampling_correction=False)
    print("TRL's defaults kept:", {k: getattr(args, k) for k in ("bf16", "gradient_checkpointing")})
    t = ParityGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          reward_funcs=short, args=args, parity=ParityOptions(),
                          train_dataset=datasets.Dataset.from_list(
                              [{"prompt": q} for q in chat_questions(64)]))
    t.train()
    keys = ("clip_ratio/region_mean", "clip/frac", "clip/phantom_frac",
            "mismatch/beta_abs_mean", "mismatch/kernel_gap_abs_mean")
    for row in (h for h in t.state.log_history if "reward" in h):
        print(json.dumps({k: round(row[k], 6) for k in keys if k in row}))


if __name__ == "__main__":
    main()
