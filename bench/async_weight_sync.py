"""What one AsyncGRPO weight sync costs through parity's directory transfer, against a running
vLLM server (VLLM_SERVER_DEV_MODE=1) serving MODEL:

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \\
        --model DIR --served-model-name DIR --host 127.0.0.1 --port 8000 --dtype bfloat16 \\
        --enforce-eager --logprobs-mode processed_logprobs
    python -m bench.async_weight_sync --model DIR --server http://127.0.0.1:8000 \\
        --dirs /dev/shm/parity-sync /tmp/parity-sync

Each sync sends the policy after a step of size `--lr` on every weight (sign-SGD, the size of an
early Adam step), as TRL's trainer does: pause, write, reload, tag, resume, then the probe check.
Prints one row per directory: seconds per phase (medians over `--syncs`) and bytes.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.report import Table, json_option, publish
from bench.timing import measure
from parity.integrations.weight_sync import DirectoryWeightTransfer, named_tensors
from parity.models.loading import load_policy
from parity.models.precision import low_precision_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--dirs", nargs="+", default=["/tmp/parity-sync"])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = json_option(ap, "async_weight_sync").parse_args()
    master, tok = load_policy(a.model)
    probe = tok("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    t = Table("async_weight_sync", f"{a.model} served at {a.server}: one weight sync, median of "
                                   f"{a.syncs} after a cold one",
              [("directory", None), ("bytes", "{:.3g}"), ("write s", "{:.2f}"),
               ("reload s", "{:.2f}"), ("pause+resume+check s", "{:.2f}"), ("total s", "{:.2f}"),
               ("probe gap", "{:.3g}"), ("probe moved", "{:.3g}")])
    for d in a.dirs:
        wt = DirectoryWeightTransfer(a.server, d)
        wt.init_weight_transfer()
        ref = low_precision_copy(master, wt.dtype)
        wt.attach(ref, probe)

        def step() -> None:
            with torch.no_grad():
                for p in master.parameters():
                    p.add_(a.lr * torch.randn_like(p).sign())

        def sync(_: None, wt=wt) -> dict:
            wt.pause()
            wt.send_weights(named_tensors(master))
            wt.resume()
            return dict(wt.last)
        took = measure(sync, setup=step, warmup=1, repeats=a.syncs)  # the first sync is cold
        wt.destroy()
        rows = [{**r, "total_s": s} for r, s in zip(took.results, took.samples)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        rest = med["total_s"] - med["sync/write_s"] - med["sync/reload_s"]
        t.add(d, med["sync/bytes"], med["sync/write_s"], med["sync/reload_s"], rest,
              med["total_s"], med["sync/probe_gap_abs_mean"], med.get("sync/probe_moved_abs_mean"))
    publish("async_weight_sync", [t], a)

if __name__ == "__main__":
    main()
