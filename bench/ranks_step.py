"""What multi-process training costs: one process against torchrun ranks on the same work.

    python -m bench.ranks_step [--model text] [--steps 6] [--ranks 2] [--engines hf,vllm]

Runs the same `neg-length` GRPO steps (fp32 recipe, so the runs stay equal) as one process with
every core, and as `--ranks` processes with a core each under DDP and under FSDP, and prints the
mean over steps 2..N of the rollout, update and step times (rank 0's metrics: the slowest rank
per step). On one machine the ranks share its cores, so this measures the price of the
collectives and of the smaller per-rank batches, not a speed-up; across machines each rank
brings its own cores. Compare rows of one run: absolute times drift on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import Table, engines_option, json_option, publish


def run(args: list[str], ranks: int, threads: int, out: Path) -> list[dict]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    p = subprocess.run(launcher + ["-m", "parity", "train", *args, "--threads", str(threads),
                                   "--out", str(out)], capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="text")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = json_option(engines_option(ap), "ranks_step").parse_args()
    cores = os.cpu_count() or 1
    common = ["--task", "neg-length", "--model", a.model, "--recipe", "fp32", "--steps",
              str(a.steps), "--max-new-tokens", str(a.max_new_tokens), "--no-progress",
              "--report-to", "none"]
    t = Table("ranks_step", f"{a.model}, neg-length, 8x8 completions, <= {a.max_new_tokens} "
                            f"tokens, fp32, mean of steps 2..{a.steps}, {cores} cores",
              [("engine", None), ("launch", None), ("threads", None, "right"),
               ("rollout s", "{:.3f}"), ("train s", "{:.3f}"), ("step s", "{:.3f}"),
               ("vs one process", "{:.2f}x"),
               ("reward, last step", "{:+.3f}")])
    per_rank = max(1, cores // a.ranks)
    launches = [("one process", 1, cores, []),
                (f"torchrun x{a.ranks}, DDP", a.ranks, per_rank, ["--parallel", "ddp"]),
                (f"torchrun x{a.ranks}, FSDP", a.ranks, per_rank, ["--parallel", "fsdp"])]
    with tempfile.TemporaryDirectory() as tmp:
        for engine in a.engines:
            base = None
            for name, ranks, threads, extra in launches:
                rows = run(common + extra + ["--engine", engine], ranks, threads,
                           Path(tmp) / f"{engine}_{name.replace(' ', '_')}")
                mean = {k: statistics.mean(r[k] for r in rows)
                        for k in ("time/rollout_s", "time/train_s", "time/step_s")}
                base = base or mean["time/step_s"]
                t.add(engine, name, f"{ranks} x {threads}", mean["time/rollout_s"],
                      mean["time/train_s"], mean["time/step_s"], mean["time/step_s"] / base,
                      rows[-1]["reward/mean"])
    publish("ranks_step", [t], a)

if __name__ == "__main__":
    main()
