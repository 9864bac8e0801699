"""The precision gap and the shadow's kernel gap against each engine, side by side in one process.

    python -m bench.kernel_gap                       # ladder-w512, parity's bf16 engine, 128 x 32
    python -m bench.kernel_gap --model arith --engines hf:bf16,vllm:bf16,vllm:fp16 \
        --json docs/data/bench/kernel_gap-arith.json
    python -m bench.kernel_gap --device cuda --model text     # GPU kernels (hf engine)
    python -m bench.kernel_gap --model smollm2-135m --prompts 8 --group 8 --new-tokens 64 \
        --engines hf:bf16,vllm:bf16,vllm:fp16 --json docs/data/bench/kernel_gap-smollm2-135m.json

For each engine (name:dtype) it samples one batch at T = 1 on the model's own weights, then:

- `|l_pi - l_mu|`: an fp32 trainer's log-prob against the engine's, per token (α + β at sync),
  with its signed mean, its max and the share of tokens beyond 0.05;
- the kernel gap |ℓ_s − ℓ_μ| (α at θ = θ_old) of every shadow parity can compute, and the
  seconds each shadow forward took over the batch: `engine` (an engine-dtype copy with
  parity's engine attention, `--shadow-kernels engine`), `independent` (the trainer's own
  attention, sdpa), `eager` (transformers' eager attention), `scored` (the engine scores the
  finished sequences itself: `--shadow-kernels scored`, including its weight load).

On CUDA, `--reductions-off` turns cuBLAS's reduced-precision reductions in bf16/fp16 matrix
products off (`torch.backends.cuda.matmul.allow_*_reduced_precision_reduction`), to see whether
they are what the shadow misses. Chat models get their prompts through the chat template.
Absolute seconds drift on a shared machine; compare the rows of one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.report import Table, json_option, publish
from bench.timing import measure
from parity import testbed
from parity.diagnostics import Shadow
from parity.engines import EngineSpec, make_engine, stop_token_ids
from parity.logprobs import Sampling
from parity.models.forward import score
from parity.models.loading import load_policy
from parity.tasks.data import text_prompts


def prompts_for(tok, n: int) -> list[list[int]]:
    texts = text_prompts(n)
    if getattr(tok, "chat_template", None):
        return [tok.apply_chat_template([{"role": "user", "content": t}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in texts]
    return [tok(t)["input_ids"] for t in texts]


def measure_engine(master, tok, model_dir: Path, name: str, dtype: str,
                   prompts: list[list[int]], a: argparse.Namespace) -> dict:
    s = Sampling()
    eng = make_engine(name, EngineSpec(master, str(model_dir), dtype, stop_token_ids(master, tok),
                                       tok.pad_token_id, a.seed,
                                       max(map(len, prompts)) + a.new_tokens, len(prompts)))
    try:
        eng.sync(master)
        device = torch.device(a.device)
        took = measure(lambda: eng.generate(prompts, a.new_tokens, s,
                                            torch.Generator().manual_seed(a.seed)),
                       warmup=0, repeats=1, device=device)
        r, sample_s = took.results[0], took.median
        mask = r.completion_mask
        n = mask.sum()
        with torch.no_grad():
            gap = (score(master, r, s) - r.engine_logprobs) * mask
        row = {"engine": name, "dtype": dtype, "tokens": int(n), "sample_s": sample_s,
               "log_ratio_abs_mean": float(gap.abs().sum() / n),
               "log_ratio_mean": float(gap.sum() / n), "log_ratio_abs_max": float(gap.abs().max()),
               "frac_beyond_0.05": float(((gap.abs() > 0.05) & (mask > 0)).sum() / n),
               "shadows": {}}
        for kernels in ("engine", "independent", "eager", "scored"):
            sh = Shadow(master, dtype, "fp32", kernels=kernels.replace("eager", "independent"),
                        engine=eng)
            if kernels == "eager" and sh.model is not None:
                sh.model.set_attn_implementation("eager")
            sh.identity = False   # an fp32 engine's shadow is scored too, not skipped
            if sh.model is None and sh.engine is None:
                continue
            took = measure(lambda sh=sh: sh.logprobs(master, r, s), warmup=0, repeats=1,
                           device=device)
            alpha = (took.results[0] - r.engine_logprobs).abs() * mask
            row["shadows"][kernels] = {"kernel_gap_abs_mean": float(alpha.sum() / n),
                                       "kernel_gap_abs_max": float(alpha.max()),
                                       "seconds": took.median}
        return row
    finally:
        eng.close()


def tables(rows: list[dict], model: str, completions: int, new_tokens: int) -> list[Table]:
    """Two tables of `measure_engine`'s rows: each engine against the fp32 trainer, and each
    shadow's kernel gap against its engine."""
    title = f"{model}: {completions} completions of <= {new_tokens} tokens, T = 1"
    eng = Table("engines", title + ": an fp32 trainer against each engine",
                [("engine", None), ("tokens", "{}"), ("mean abs(l_pi - l_mu)", "{:.4f}"),
                 ("mean (l_pi - l_mu)", "{:+.4f}"), ("max", "{:.3f}"),
                 ("beyond 0.05", "{:.1%}"), ("sample s", "{:.2f}")])
    sha = Table("shadows", title + ": the kernel gap of each shadow against its engine",
                [("engine", None), ("shadow", None), ("kernel gap", "{:.2e}"), ("max", "{:.2e}"),
                 ("shadow s", "{:.2f}")])
    for r in rows:
        name = f"{r['engine']} {r['dtype']}"
        eng.add(name, r["tokens"], r["log_ratio_abs_mean"], r["log_ratio_mean"],
                r["log_ratio_abs_max"], r["frac_beyond_0.05"], r["sample_s"])
        for shadow, sh in r["shadows"].items():
            sha.add(name, shadow, sh["kernel_gap_abs_mean"], sh["kernel_gap_abs_max"],
                    sh["seconds"])
    return [eng, sha]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--engines", default="hf:bf16", help="name:dtype, comma-separated")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (vLLM: its CUDA build)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reductions-off", action="store_true", help="CUDA: full-precision "
                    "reductions in bf16/fp16 matrix products")
    a = json_option(ap, "kernel_gap").parse_args()
    if a.reductions_off:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    model_dir = testbed.resolve_model(a.model)
    master, tok = load_policy(model_dir)
    master.eval().to(a.device)
    prompts = [p for p in prompts_for(tok, a.prompts) for _ in range(a.group)]
    rows = [measure_engine(master, tok, model_dir, *spec.split(":"), prompts, a)
            for spec in a.engines.split(",")]
    publish("kernel_gap", tables(rows, a.model, len(prompts), a.new_tokens), a,
            torch.device(a.device))

if __name__ == "__main__":
    main()
