"""Does parity's `vllm` engine sample at vLLM's own rate? The same prompts, completions and
sampling through parity's engine (`Engine.generate`: a seed per row, processed log-probs
recorded) and through vLLM's `LLM.generate` as a user would call it (one seed for the engine,
no log-probs), side by side.

    python -m bench.vllm_rate                       # smollm2-135m, 64 completions of <= 64 tokens

Each side runs in its own process (one vLLM engine per process, as parity runs it), in eager
mode and bf16, and times `--repeats` generate calls after one warm-up call; the sides
alternate. Tokens per second count the completion tokens sampled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench.report import ROOT, Table, json_option, publish


def measure(side: str, model: str, n: int, tokens: int, repeats: int) -> dict:
    """One side in this process: the median rate of `repeats` generate calls."""
    import os
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from parity import testbed
    from parity.engines import EngineSpec, make_engine
    from parity.logprobs import Sampling
    from parity.models.loading import load_policy
    from parity.tasks.data import text_prompts
    model_dir = str(testbed.resolve_model(model))
    master, tok = load_policy(model_dir)
    prompts = [tok(p)["input_ids"] for p in text_prompts(n)]
    max_len = max(map(len, prompts)) + tokens
    if side == "parity":
        eng = make_engine("vllm", EngineSpec(master.eval(), model_dir, "bf16",
                                             [tok.eos_token_id], tok.pad_token_id, 0, max_len,
                                             n))
        eng.sync(master)
        s = Sampling(1.0, 1.0, 0)

        def call(i: int) -> int:
            r = eng.generate(prompts, tokens, s, torch.Generator().manual_seed(i))
            return int(r.completion_mask.sum())
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, seed=0,
                  max_model_len=max_len + 1, max_num_batched_tokens=max(n * max_len, 2048))
        params = SamplingParams(temperature=1.0, max_tokens=tokens)

        def call(i: int) -> int:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    call(0)    # warm-up: the first call holds vLLM's first allocations
    rates, lens = [], []
    for i in range(1, repeats + 1):
        t0 = time.perf_counter()
        n_tok = call(i)
        rates.append(n_tok / (time.perf_counter() - t0))
        lens.append(n_tok / n)
    return {"side": side, "tok_s": statistics.median(rates), "len_mean": statistics.mean(lens)}


def table(rows: list[dict], a: argparse.Namespace) -> Table:
    t = Table("vllm_rate", f"{a.model}: {a.completions} completions of <= {a.tokens} tokens, "
                           f"bf16, T = 1, eager, median of {a.repeats} calls per run",
              [("side", None), ("run", "{}"), ("mean length", "{:.1f}"), ("tok/s", "{:.0f}"),
               ("÷ vLLM's own", "{:.2f}")])
    raw = statistics.median(r["tok_s"] for r in rows if r["side"] == "vllm")
    for r in rows:
        t.add(r["side"], r["run"], r["len_mean"], r["tok_s"], r["tok_s"] / raw)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2, help="alternating runs per side")
    ap.add_argument("--side", choices=["parity", "vllm"], help=argparse.SUPPRESS)
    a = json_option(ap, "vllm_rate").parse_args()
    if a.side:      # a child: one side, its result as the last line
        print(json.dumps(measure(a.side, a.model, a.completions, a.tokens, a.repeats)))
        return
    rows = []
    for run in range(1, a.runs + 1):
        for side in ("vllm", "parity"):
            print(f"{side}, run {run} ...", flush=True)
            out = subprocess.run([sys.executable, "-m", "bench.vllm_rate", "--side", side,
                                  "--model", a.model,
                                  "--completions", str(a.completions), "--tokens",
                                  str(a.tokens), "--repeats", str(a.repeats), "--json", ""],
                                 check=True, capture_output=True, text=True, cwd=ROOT).stdout
            rows.append({**json.loads(out.strip().splitlines()[-1]), "run": run})
    publish("vllm_rate", [table(rows, a)], a)


if __name__ == "__main__":
    main()
