"""Does the current code judge a committed reproduction exactly as it was judged?

    python scripts/same_claims.py docs/reproduce

Reads what the reproduction measured (its audits, scale.json, drivers.json and every sweep's
summary.json), passes it to the reproduction's `judge` as `parity reproduce` does, and compares
each claim (statement, measured values, verdict, reason) with the directory's claims.json.
Prints `same: N claims` and exits 0, or a line per difference and exits 1. Used with
scripts/same_metrics.py to show that a change to the code leaves what the reproduction
concludes unchanged, without rerunning its 90 minutes of training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parity.experiments import reproduce as R


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def rejudged(out: Path) -> tuple[list[dict], list[dict]]:
    """(the claims judged now, the claims the directory holds)."""
    held = json.loads((out / "claims.json").read_text())
    plans = {p.name: p for p in (R.QUICK, R.FULL, R.VLLM)}
    if not isinstance(held.get("plan"), str) or held["plan"] not in plans:
        raise SystemExit(f"{out}: not a `parity reproduce` directory of the quick, full or vllm "
                         f"plan (its claims.json names plan {held.get('plan')!r})")
    plan = plans[held["plan"]]
    sweeps = out / "sweeps"
    summary = lambda name: _read(sweeps / name / "summary.json")
    algos = {obj: s for obj in plan.algorithms if (s := summary(f"arith-{obj}")) is not None}
    claims = R.judge(_read(out / "audits" / "bf16-vs-fp32" / "audit.json"),
                     _read(out / "audits" / "fp16-vs-fp32" / "audit.json"),
                     _read(out / "scale" / "scale.json") or {}, summary("neg-length"),
                     summary("arith"), summary("small-lr"), held["eps_run"], plan,
                     held["calibration"].get("arith", {}).get("eps"), algos,
                     _read(out / "drivers.json"), summary("arith-async"), summary("arith-lora"),
                     summary("arith-long"))
    # through JSON, as claims.json holds them (tuples become lists)
    return json.loads(json.dumps([c.to_dict() for c in claims])), held["claims"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    now, held = rejudged(Path(argv[0]))
    diffs = [f"{a.get('id')}: {k}: {a.get(k)!r} (now) != {b.get(k)!r} (held)"
             for a, b in zip(now, held) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if len(now) != len(held):
        diffs.append(f"{len(now)} claims now, {len(held)} held")
    if diffs:
        print("\n".join(diffs))
        print(f"{len(diffs)} differences")
        return 1
    print(f"same: {len(now)} claims, every statement, measurement and verdict equal")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
