"""TRL's AsyncGRPOTrainer against a running vLLM server, with parity's weight sync and
diagnostics: the seed's sanity check (reward = -length, chat prompts) on SmolLM2-135M-Instruct.

Start the server first (development mode; the served name must be the model's directory,
which is what the trainer asks for), here a bf16 one as in the seed:

    DIR=$(parity testbed build smollm2-135m | tail -1)     # or any HF model directory
    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server \\
        --model $DIR --served-model-name $DIR --host 127.0.0.1 --port 8000 \\
        --dtype bfloat16 --enforce-eager --logprobs-mode processed_logprobs --max-model-len 1024 \\
        --max-num-batched-tokens 16384

then, in another shell:

    python examples/trl_async_grpo.py --model $DIR --recipe bf16-engine     # the seed's setup
    python examples/trl_async_grpo.py --model $DIR --recipe bf16-shadow
    python examples/trl_async_grpo.py --model $DIR --recipe tis
    python examples/trl_async_grpo.py --model $DIR --recipe bf16-shadow --scored-shadow

`--max-num-batched-tokens` large enough for every prompt in flight keeps vLLM from splitting a
prompt's prefill over steps: on CPU, a seeded request (AsyncGRPO seeds each one) whose prefill
is split kills vLLM 0.32's engine ("CPU Generator does not use offset"). `--recipe fp32` needs
a server started with `--dtype float32`, `--recipe fp16` one with `--dtype float16`. Prints,
per step, TRL's clip count next to parity's attribution of it and what the weight sync cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import datasets
from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig

from parity import testbed
from parity.config import TASK_DEFAULTS
from parity.errors import ParityError
from parity.integrations.trl_async import (
    AsyncParityOptions,
    ParityAsyncGRPOTrainer,
    plain_response_template,
)
from parity.tasks.data import chat_questions

LEARNING_RATE = next(f.default for f in dataclasses.fields(AsyncGRPOConfig)
                     if f.name == "learning_rate")


def neg_length(prompts, completions, completion_ids, **_):
    """The seed's sanity reward: the shorter the answer, the better."""
    return [-float(len(c)) for c in completion_ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TASK_DEFAULTS["neg-length-chat"]["model"],
                    help="model directory the server serves")
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--recipe", default="bf16-engine")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=LEARNING_RATE, help="AsyncGRPOConfig's default")
    ap.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_completion_length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scored-shadow", action="store_true",
                    help="the server scores the shadow (no kernel gap; docs/trl-async.md)")
    ap.add_argument("--out", default="runs/trl-async-example")
    ap.add_argument("--json", default=None, help="also write TRL's log history and the wall "
                    "time here (scripts/async_sanity.py reads it)")
    a = ap.parse_args()
    t0 = time.time()

    model_dir = str(testbed.resolve_model(a.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    # AsyncGRPO parses every completion with a response template and knows a few model
    # families' only; a model that calls no tools can read its completions as plain text.
    if getattr(tok, "response_template", None) is None:
        tok.response_template = plain_response_template(tok)
    dataset = datasets.Dataset.from_list([{"prompt": q} for q in chat_questions(512, a.seed)])
    fp16 = a.recipe == "fp16"
    args = AsyncGRPOConfig(
        output_dir=a.out, use_cpu=True, max_steps=a.steps, learning_rate=a.lr,
        per_device_train_batch_size=a.batch, token_budget=0, num_generations=a.group,
        max_completion_length=a.max_tokens, logging_steps=1, seed=a.seed,
        bf16=a.recipe == "bf16", fp16=fp16, gradient_checkpointing=False,
        save_strategy="no", report_to=[], disable_tqdm=True, vllm_server_base_url=a.server)
    trainer = ParityAsyncGRPOTrainer(model_dir, neg_length, args, train_dataset=dataset,
                                     processing_class=tok,
                                     parity=AsyncParityOptions.from_recipe(
                                         a.recipe, scored_shadow=a.scored_shadow))
    trainer.train()
    if a.json:
        Path(a.json).write_text(json.dumps({"wall_s": time.time() - t0, "recipe": a.recipe,
                                            "seed": a.seed, "scored_shadow": a.scored_shadow,
                                            "log": trainer.state.log_history}))

    cols = ("reward", "completions/mean_length", "completions/clipped_ratio",
            "clip_ratio/region_mean", "clip/phantom_frac", "mismatch/beta_abs_mean",
            "mismatch/kl_k3", "mismatch/alpha_abs_mean", "staleness/mean", "time/shadow_s",
            "perf/weight_sync_s", "sync/probe_gap_abs_mean")
    print("\nstep  " + "  ".join(f"{c.split('/')[-1]:>18}" for c in cols))
    for h in trainer.state.log_history:
        if "clip/frac" in h:
            print(f"{h['step']:>4}  " + "  ".join(f"{h.get(c, float('nan')):>18.4g}"
                                                  for c in cols))


if __name__ == "__main__":
    try:
        main()
    except ParityError as e:
        sys.exit(f"parity: error: {e}")
