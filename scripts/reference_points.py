"""The measured reference points an audit's advice compares a user's figures with.

    python scripts/reference_points.py [--check]

Reads the committed audits (docs/reproduce/smollm2-135m/audits/, docs/data/live-server-audit.json,
docs/reproduce/audits/) and writes parity/data/reference_points.json, which
`parity.audit.advice` ships
with the package, and their table in docs/diagnostics.md (What to do). `--check` exits 1 when
either differs from what the audits give, as tests/test_advice.py does: the figures are typed
nowhere, only read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "parity" / "data" / "reference_points.json"
DOC = ROOT / "docs" / "diagnostics.md"
BEGIN, END = "<!-- reference points: scripts/reference_points.py -->", "<!-- /reference points -->"
COLUMNS = (("mismatch/log_ratio_abs_mean", "\\|ℓ_π − ℓ_μ\\|"),
           ("mismatch/prob_diff_abs_mean", "\\|π − μ\\|"), ("mismatch/kl_k3", "KL k3"),
           ("clip/phantom_frac@0.2", "phantom at ε = 0.2"),
           ("clip/phantom_frac@0.05", "phantom at ε = 0.05"),
           ("mismatch/alpha_abs_mean", "parity shadow's \\|α\\|"))

# What a reference row shows, by parity's metric name (docs/design.md, Metrics).
KEYS = ("mismatch/log_ratio_abs_mean", "mismatch/prob_diff_abs_mean", "mismatch/kl_k3",
        "mismatch/alpha_abs_mean")
# An audit written before `mismatch/log_ratio_abs_mean` existed: |ℓ_π − ℓ_μ| = |α + β| is |β|
# to within |α|, and with parity's own engine |α| is below this, so |β| stands for it.
ALPHA_NEGLIGIBLE = 1e-4


def _phantom(table: list[dict[str, float]], eps: float) -> float | None:
    return next((r["phantom_frac"] for r in table if abs(r["eps"] - eps) < 1e-12), None)


def _from_audit(path: Path, label: str, engine: str) -> dict[str, Any]:
    a = json.loads(path.read_text())
    m = a["metrics"]
    values = {k: m.get(k) for k in KEYS}
    if (values["mismatch/log_ratio_abs_mean"] is None
            and m["mismatch/alpha_abs_mean"] < ALPHA_NEGLIGIBLE):
        values["mismatch/log_ratio_abs_mean"] = m["mismatch/beta_abs_mean"]
    values["clip/phantom_frac@0.2"] = _phantom(a["phantom_vs_eps"], 0.2)
    values["clip/phantom_frac@0.05"] = _phantom(a["phantom_vs_eps"], 0.05)
    return {"label": label, "model": a["model"], "engine": engine,
            "engine_dtype": a["engine_dtype"], "input": a["input"],
            "tokens": a["tokens"], "source": str(path.relative_to(ROOT)), "values": values}


def _from_live(path: Path) -> list[dict[str, Any]]:
    d = json.loads(path.read_text())
    out = []
    for r in d["rows"]:
        values = {"mismatch/log_ratio_abs_mean": r["log_ratio_abs_mean"],
                  "mismatch/prob_diff_abs_mean": r["prob_diff_abs_mean"],
                  "mismatch/kl_k3": r["kl_k3"],
                  "mismatch/alpha_abs_mean": r["kernel_gap_alpha_abs_mean"],
                  "clip/phantom_frac@0.2": r["phantom_frac"],
                  "clip/phantom_frac@0.05": r["phantom_frac_eps_0.05"]}
        out.append({"label": f"vLLM {r['server_dtype']} (CPU build, server)", "model": d["model"],
                    "engine": "vllm", "engine_dtype": r["server_dtype"],
                    "input": f"task {d['task']}", "tokens": r["tokens"],
                    "source": str(path.relative_to(ROOT)), "values": values})
    return out


def build() -> dict[str, Any]:
    real = ROOT / "docs" / "reproduce" / "smollm2-135m" / "audits"
    testbed = ROOT / "docs" / "reproduce" / "audits"
    rows = [_from_audit(real / "bf16" / "audit.json", "parity's engine, bf16", "hf"),
            _from_audit(real / "fp16" / "audit.json", "parity's engine, fp16", "hf"),
            *_from_live(ROOT / "docs" / "data" / "live-server-audit.json"),
            _from_audit(testbed / "bf16-arith" / "audit.json", "parity's engine, bf16", "hf"),
            _from_audit(testbed / "bf16-vs-fp32" / "audit.json", "parity's engine, bf16", "hf"),
            _from_audit(testbed / "fp16-vs-fp32" / "audit.json", "parity's engine, fp16", "hf")]
    return {"written_by": "python scripts/reference_points.py", "trainer_dtype": "fp32",
            "rows": rows}


def markdown(refs: dict[str, Any]) -> str:
    def cell(key: str, v: float | None) -> str:
        return "—" if v is None else f"{v:.2%}" if key.startswith("clip/") else f"{v:.2g}"
    lines = ["| reference | model | " + " | ".join(h for _, h in COLUMNS) + " | source |",
             "|---|---|" + "---|" * len(COLUMNS) + "---|"]
    for r in refs["rows"]:
        lines.append(f"| {r['label']} | {r['model']} | "
                     + " | ".join(cell(k, r["values"][k]) for k, _ in COLUMNS)
                     + f" | `{r['source']}` |")
    return "\n".join(lines)


def with_table(doc: str, table: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC}: the markers {BEGIN} ... {END} are missing")
    head, rest = doc.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the shipped file differs from the committed audits")
    args = ap.parse_args()
    refs = build()
    text = json.dumps(refs, indent=1) + "\n"
    doc = DOC.read_text()
    table = with_table(doc, markdown(refs))
    if args.check:
        stale = [str(p.relative_to(ROOT)) for p, now, want in ((OUT, OUT.read_text()
                 if OUT.is_file() else None, text), (DOC, doc, table)) if now != want]
        print("OUT OF DATE: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    DOC.write_text(table)
    print(f"wrote {OUT.relative_to(ROOT)} and the table in {DOC.relative_to(ROOT)}: "
          f"{len(refs['rows'])} reference rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
