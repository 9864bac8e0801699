"""What one AsyncGRPO weight sync costs through parity's directory transfer, against a running
vLLM server (VLLM_SERVER_DEV_MODE=1) serving MODEL:

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \\
        --model DIR --served-model-name DIR --host 127.0.0.1 --port 8000 --dtype bfloat16 \\
        --enforce-eager --logprobs-mode processed_logprobs
    python bench/async_weight_sync.py --model DIR --server http://127.0.0.1:8000 \\
        --dirs /dev/shm/parity-sync /tmp/parity-sync

Each sync sends the policy after a step of size `--lr` on every weight (sign-SGD, the size of an
early Adam step), as TRL's trainer does: pause, write, reload, tag, resume, then the probe check.
Prints one row per directory: seconds per phase (medians over `--syncs`) and bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from parity.integrations.weight_sync import DirectoryWeightTransfer, named_tensors
from parity.precision import low_precision_copy
from parity.runs import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--dirs", nargs="+", default=["/tmp/parity-sync"])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()
    master, tok = load_policy(a.model)
    probe = tok("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    print(f"| directory | bytes | write s | reload s | pause+resume+check s | total s | "
          f"probe gap | probe moved |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for d in a.dirs:
        wt = DirectoryWeightTransfer(a.server, d)
        wt.init_weight_transfer()
        ref = low_precision_copy(master, wt.dtype)
        wt.attach(ref, probe)
        rows = []
        for _ in range(a.syncs + 1):          # the first sync is the cold one
            with torch.no_grad():
                for p in master.parameters():
                    p.add_(a.lr * torch.randn_like(p).sign())
            t0 = time.perf_counter()
            wt.pause()
            wt.send_weights(named_tensors(master))
            wt.resume()
            rows.append({**wt.last, "total_s": time.perf_counter() - t0})
        wt.destroy()
        rows = rows[1:]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        rest = med["total_s"] - med["sync/write_s"] - med["sync/reload_s"]
        print(f"| {d} | {med['sync/bytes']:.3g} | {med['sync/write_s']:.2f} | "
              f"{med['sync/reload_s']:.2f} | {rest:.2f} | {med['total_s']:.2f} | "
              f"{med['sync/probe_gap_abs_mean']:.3g} | "
              f"{med.get('sync/probe_moved_abs_mean', float('nan')):.3g} |")


if __name__ == "__main__":
    main()
