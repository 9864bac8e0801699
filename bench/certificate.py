"""The zero-mismatch certificate (`parity audit --certify bitwise`) across engines and
kernels: each check's verdict and, where it differs, the first op and by how much.

    python -m bench.certificate [--samples 64] [--engines hf,vllm]
    python -m bench.certificate --json docs/data/bench/certificate.json

One `parity audit` process per row, bf16 engine against a bf16 trainer: parity's engine with
kernels=invariant (the `bitwise` recipe's) and with each side's own kernels, on the testbed's
text-xs and on SmolLM2-135M; and vLLM's CPU build, which runs its own kernels, against the
invariant trainer and against the trainer's own kernels.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import Table, engines_option, json_option, publish

MODELS = (("text-xs", "neg-length", 12), ("smollm2-135m", "neg-length-chat", 64))


def audit(model: str, task: str, tokens: int, engine: str, kernels: str, samples: int,
          out: Path) -> dict:
    argv = [sys.executable, "-m", "parity", "audit", "--model", model, "--task", task,
            "--engine", engine, "--engine-dtype", "bf16", "--trainer-dtype", "bf16",
            "--kernels", kernels, "--samples", str(samples), "--max-new-tokens", str(tokens),
            "--certify", "bitwise", "--no-progress", "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode not in (0, 1):   # 1: the certificate failed, which is a figure here
        raise SystemExit(f"{' '.join(argv[2:])} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads((out / "audit.json").read_text())


def _cell(check: dict) -> str:
    if check["holds"]:
        return "equal"
    v = check["value"]
    return f"{check['at']}" + (f" ({v:.3g})" if isinstance(v, float) and v == v else "")


def table(a: argparse.Namespace) -> Table:
    t = Table("certificate",
              f"parity audit --certify bitwise, bf16 engine against a bf16 trainer, "
              f"{a.samples} completions each: per check, `equal` or the first op that differs "
              f"(and its max relative error, or the log-probs' max |Δℓ|)",
              [("model", None), ("engine", None), ("kernels", None), ("verdict", None),
               ("trainer layouts", None), ("trainer vs engine", None),
               ("decode vs prefill", None), ("sampled |Δℓ| max", "{:.3g}"),
               ("mean exp(|Δℓ|)", "{:.4f}"), ("kl_k3", "{:.3g}")])
    rows = [(m, e, k) for m in MODELS for e in a.engines
            for k in ("invariant", "default")]
    with tempfile.TemporaryDirectory() as tmp:
        for i, ((model, task, tokens), engine, kernels) in enumerate(rows):
            r = audit(model, task, tokens, engine, kernels, a.samples, Path(tmp) / str(i))
            c = r["certificate"]
            t.add(model, engine, kernels, "bitwise" if c["holds"] else "not bitwise",
                  *[_cell(k) for k in c["checks"]], c["checks"][1]["tokens_max"],
                  c["bars"]["nemo-rl"]["value"], c["bars"]["prime-rl"]["value"])
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    a = json_option(engines_option(ap), "certificate").parse_args()
    publish("certificate", [table(a)], a)


if __name__ == "__main__":
    main()
