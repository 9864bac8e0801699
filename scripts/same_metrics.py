"""Do two runs' metrics.jsonl agree bit for bit, timing fields aside?

    python scripts/same_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl
    python scripts/same_metrics.py AUDIT_A/audit.json AUDIT_B/audit.json

An audit's figures (its `metrics` and its clip fractions over ε) count as one step, step 0.
Prints a table of every field that differs (step, field, A, B) and exits 1 if any does, 0 if
the two files hold the same steps with the same values. Fields that measure time (`time/*`,
`throughput/*`, `async/wait_s`) are skipped: they differ between any two runs. Used to show
that a change to the code leaves what a run computes unchanged (docs/performance.md keeps the
commands).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMING = ("time/", "throughput/", "async/wait_s", "train_runtime", "train_samples_per_second",
          "train_steps_per_second", "step_time")


def load(path: Path) -> dict[int, dict]:
    if path.suffix == ".json":  # an audit: its figures, one row
        audit = json.loads(path.read_text())
        row = dict(audit["metrics"])
        for x in audit.get("phantom_vs_eps", []):
            row.update({f"eps={x['eps']}/{k}": v for k, v in x.items() if k != "eps"})
        return {0: row}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def differences(a: dict[int, dict], b: dict[int, dict]) -> list[tuple]:
    out = []
    for step in sorted(set(a) | set(b)):
        ra, rb = a.get(step), b.get(step)
        if ra is None or rb is None:
            out.append((step, "(the whole step)", ra is not None, rb is not None))
            continue
        for k in sorted(set(ra) | set(rb)):
            if ra.get(k, "<absent>") != rb.get(k, "<absent>"):
                out.append((step, k, ra.get(k, "<absent>"), rb.get(k, "<absent>")))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    a, b = (load(Path(x)) for x in argv)
    diff = differences(a, b)
    fields = len({k for r in a.values() for k in r})
    if not diff:
        print(f"same: {len(a)} steps, {fields} fields each, every value equal (timing aside)")
        return 0
    print(f"{'step':>5}  {'field':40}  {'A':>24}  {'B':>24}")
    for step, k, x, y in diff:
        print(f"{step:>5}  {k:40}  {str(x):>24}  {str(y):>24}")
    print(f"{len(diff)} differences")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
