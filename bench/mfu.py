"""Model FLOP utilisation of the engine (prefill, decode) and of the training step, against the
matrix-product rate of this machine measured in the same run.

    python -m bench.mfu                  # ladder-w512 (the largest testbed model), batch 256
    python -m bench.mfu --model text --batch 64 --new-tokens 16
    python -m bench.mfu --device cuda --dtypes fp32,bf16,fp16   # against the GPU's own rate

FLOPs are counted as the model needs them, not as the kernels happen to run them:

- matrix products: 2 per weight per token (embeddings excluded, the LM head included);
- attention scores and values: 4 · layers · width · context per token;
- training: 3x the forward (backward = 2x).

The decode context is the prompt plus the tokens decoded so far. The reference rate is the
best of several square products (2048^3 fp32, 4096^3 bf16), timed in the same process just
before, so both numbers see the same machine load (on a GPU: 8192^3 in bf16/fp16, TF32 off as
torch leaves it). MFU = achieved FLOP/s / reference FLOP/s. Times are medians of `--reps` calls
after a warm-up, each waiting for the GPU's queue (bench/timing.py); `spread` is (max − min) /
median of those calls (for a decode step, of the whole generation's).
"""

from __future__ import annotations

import argparse

import torch

from bench.report import Table, json_option, publish
from bench.timing import CPU, measure
from parity import devices, testbed
from parity.engines.hf import HFEngine
from parity.logprobs import Rollout, Sampling
from parity.models.forward import score_full
from parity.models.loading import load_policy
from parity.models.precision import autocast


def matmul_rate(dtype: torch.dtype, n: int, reps: int = 5,
                device: torch.device = CPU) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    # the warm-up starts the thread pool, the AMX tiles, the CUDA kernels; the best repeat is
    # the rate the machine can reach
    return 2 * n**3 / measure(lambda: a @ b, warmup=1, repeats=reps, device=device).min


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in a matrix product per token: every 2-D weight except the input
    embeddings (a lookup)."""
    emb = {id(p) for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in emb)
    return n + (head.numel() if id(head) in emb else 0)  # a tied head still multiplies


def attn_flops(model: torch.nn.Module, ctx: float) -> float:
    c = model.config
    return 4 * c.num_hidden_layers * c.hidden_size * ctx


def workload_parser(doc: str, dtypes: str) -> argparse.ArgumentParser:
    """The decode workload of this and bench/decode_variants.py: the largest testbed model,
    batch 256, random 16-token prompts, 32 new tokens."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=testbed.LARGEST)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default=dtypes)
    return ap


def main() -> None:
    ap = workload_parser(__doc__, "fp32,bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = json_option(ap, "mfu").parse_args()

    dev = devices.resolve(a.device)
    model_dir = testbed.ensure(a.model)
    master, tok = load_policy(model_dir)
    master.to(dev)
    N = matmul_params(master)
    B, P, T = a.batch, a.prompt_tokens, a.new_tokens
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, len(tok), (B, P), generator=g).tolist()
    t = Table("mfu", f"{a.model}: {N / 1e6:.2f}M weights in matrix products, batch {B}, prompt "
                     f"{P} tokens, {T} new tokens, {devices.describe(dev)}",
              [("phase", None), ("dtype", None), ("time s", "{:.4f}"), ("GFLOP", "{:.2f}"),
               ("GFLOP/s", "{:.1f}"), ("matmul GFLOP/s", "{:.0f}"), ("MFU", "{:.1%}"),
               ("spread", "{:.0%}")])
    rows = []
    for dtype in a.dtypes.split(","):
        td = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        n = 8192 if dev.type == "cuda" and dtype != "fp32" else 2048 if dtype == "fp32" else 4096
        ref = max(matmul_rate(td, n, device=dev) for _ in range(2))
        # No token ends a completion (eos -1): every row decodes T tokens, as the FLOPs assume.
        eng = HFEngine(master, dtype, [-1], tok.pad_token_id)
        s = Sampling()
        pre = measure(lambda eng=eng, s=s: eng.generate(prompts, 1, s, g), repeats=a.reps,
                      device=dev)
        whole = measure(lambda eng=eng, s=s: eng.generate(prompts, T + 1, s, g), repeats=a.reps,
                        device=dev)
        t_dec = (whole.median - pre.median) / T
        f_pre = B * P * 2 * N + B * sum(attn_flops(master, c) for c in range(1, P + 1))
        f_dec = B * (2 * N + attn_flops(master, P + T / 2))
        rows.append(("prefill", dtype, pre.median, f_pre, ref, pre.spread))
        rows.append(("decode step", dtype, t_dec, f_dec, ref, whole.spread))
        # the training step: forward with grad over prompt + completion, backward, AdamW
        r = eng.generate(prompts, T, s, g)
        model = load_policy(model_dir)[0].train().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step(r: Rollout = r, model=model, opt=opt, dtype=dtype, s=s) -> None:
            with autocast(dtype, dev):
                logp = score_full(model, r, s).logp
            (-logp.sum() / B).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        train = measure(step, repeats=a.reps, device=dev)
        L = P + T
        f_train = 3 * (B * L * 2 * N + B * sum(attn_flops(master, c) for c in range(1, L + 1)))
        rows.append(("train step", dtype, train.median, f_train, ref, train.spread))

    for phase, dtype, sec, f, ref, spread in rows:
        t.add(phase, dtype, sec, f / 1e9, f / sec / 1e9, ref / 1e9, f / sec / ref, spread)
    publish("mfu", [t], a, dev)


if __name__ == "__main__":
    main()
