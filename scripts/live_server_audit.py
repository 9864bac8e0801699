"""A live audit of real vLLM servers, one per engine dtype, against an fp32 trainer.

    python scripts/live_server_audit.py [--model smollm2-135m] [--dtypes bf16,fp16]
        [--samples 64] [--group 8] [--max-new-tokens 64] [--temperature 1] [--top-p 1]
        [--out docs/data/live-server-audit.json]

For each dtype a vLLM OpenAI server is started on 127.0.0.1 (eager, processed log-probs), the
model is audited with `parity audit --server URL --trainer-dtype fp32` on the chat prompts of
`neg-length-chat` (the server's own chat template, /v1/chat/completions) at temperature 1 or the
one given, and the server is stopped. Prints a table and writes the figures, the command and
wall times as JSON (docs/serving.md shows them).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import testbed  # noqa: E402
from parity.cli import main as parity  # noqa: E402
from parity.config import TASK_DEFAULTS, AuditSettings  # noqa: E402
from parity.engines.server import LocalVLLM  # noqa: E402

TASK = "neg-length-chat"
VLLM_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FIGURES = {"log_ratio_abs_mean": "mismatch/log_ratio_abs_mean",
           "log_ratio_abs_max": "mismatch/log_ratio_abs_max", "kl_k1": "mismatch/kl_k1",
           "clip_frac": "clip/frac",
           "beta_abs_mean": "mismatch/beta_abs_mean", "beta_mean": "mismatch/beta_mean",
           "beta_abs_max": "mismatch/beta_abs_max", "phantom_frac": "clip/phantom_frac",
           "prob_diff_abs_mean": "mismatch/prob_diff_abs_mean", "kl_k3": "mismatch/kl_k3",
           "kernel_gap_alpha_abs_mean": "mismatch/alpha_abs_mean"}


def audit_one(model_dir: Path, dtype: str, args: argparse.Namespace, tmp: Path) -> dict:
    t0 = time.perf_counter()
    server = LocalVLLM(model_dir, VLLM_DTYPE[dtype], tmp / f"vllm-{dtype}.log",
                       max_model_len=1024)
    try:
        url = server.wait()
        started = time.perf_counter() - t0
        out = tmp / f"audit-{dtype}"
        flags = ["--model", args.model, "--engine-dtype", dtype, "--trainer-dtype", "fp32",
                 "--task", TASK, "--samples", str(args.samples), "--group",
                 str(args.group), "--max-new-tokens", str(args.max_new_tokens), "--eps",
                 str(AuditSettings.eps),
                 "--temperature", str(args.temperature), "--top-p", str(args.top_p),
                 # vLLM-CPU decodes fp16 at about a third of its bf16 rate, on a shared machine
                 "--server-timeout-s", "900"]
        t1 = time.perf_counter()
        code = parity(["audit", "--server", url, *flags, "--out", str(out), "--no-progress"])
        if code != 0:
            raise SystemExit(f"parity audit --server failed for {dtype} (exit {code})")
        audited = time.perf_counter() - t1
    finally:
        server.stop()
    res = json.loads((out / "audit.json").read_text())
    return {"server_dtype": dtype, "command": "parity audit --server URL " + " ".join(flags),
            "server_start_s": round(started, 1), "audit_wall_s": round(audited, 1),
            "completions": res["completions"], "tokens": res["tokens"],
            **{k: res["metrics"][v] for k, v in FIGURES.items()},
            "phantom_frac_eps_0.05": next(r["phantom_frac"] for r in res["phantom_vs_eps"]
                                          if r["eps"] == 0.05),
            "server": res["server"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TASK_DEFAULTS[TASK]["model"])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--group", type=int, default=AuditSettings.group)
    ap.add_argument("--max-new-tokens", type=int, default=TASK_DEFAULTS[TASK]["max_new_tokens"])
    ap.add_argument("--temperature", type=float, default=AuditSettings.temperature)
    ap.add_argument("--top-p", type=float, default=AuditSettings.top_p)
    ap.add_argument("--out", default="docs/data/live-server-audit.json")
    args = ap.parse_args()
    model_dir = testbed.resolve_model(args.model)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [audit_one(model_dir, d, args, Path(tmp)) for d in args.dtypes.split(",")]
    result = {"script": "python scripts/live_server_audit.py " + " ".join(sys.argv[1:]),
              "model": args.model, "trainer_dtype": "fp32", "task": TASK,
              "temperature": args.temperature, "top_p": args.top_p,
              "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    t = Table(title=f"live audit of vLLM serving {args.model} against an fp32 trainer, T = "
                    f"{args.temperature:g}, top-p {args.top_p:g} ({result['wall_s']:.0f} s in all)")
    for col in ("server", "tokens", "log-probs", "|lpi - lmu|", "mean lpi - lmu",
                f"clipped @{AuditSettings.eps:g}", "|beta|", "mean beta", "|alpha|",
                f"phantom @{AuditSettings.eps:g}",
                "phantom @0.05", "mean |pi - mu|", "start s", "audit s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["server_dtype"], str(r["tokens"]), r["server"]["logprobs"].split(":")[0],
                  f"{r['log_ratio_abs_mean']:.4f}", f"{-r['kl_k1']:+.5f}",
                  f"{r['clip_frac']:.2%}", f"{r['beta_abs_mean']:.4f}",
                  f"{r['beta_mean']:+.5f}", f"{r['kernel_gap_alpha_abs_mean']:.4f}",
                  f"{r['phantom_frac']:.2%}", f"{r['phantom_frac_eps_0.05']:.2%}",
                  f"{r['prob_diff_abs_mean']:.5f}", f"{r['server_start_s']:.0f}",
                  f"{r['audit_wall_s']:.0f}")
    Console(width=160).print(t)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
