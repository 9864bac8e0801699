"""README.md's picture: phantom clipping stalls training, and taking β out of the ratio fixes it.

    python scripts/readme_figure.py                      # from the committed runs' metrics
    python scripts/readme_figure.py --stall RUN --fix RUN --keep

The runs are README.md's third path in ("Show me phantom clipping and its fix"):

    parity sweep --task arith --recipes bf16-engine,bf16-shadow --seeds 0 --eps-low 0.0013 \
        --eps-high 0.0013 --steps 150 --out sweeps/phantom

with RUN sweeps/phantom/runs/arith-default-bf16-engine-s0 (stall) and ...-bf16-shadow-s0 (fix).
`--keep` writes the figures it draws from (KEPT, per step) into docs/data/phantom-demo/, where
the figure is drawn from by default. Left: the reward of both runs. Right: the stalled run's
clipped tokens split into those the policy's own change clips (α alone would clip them) and
those clipped by the precision gap β alone (phantom), beside the fixed run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from parity.reports import load_metrics  # noqa: E402

DATA = ROOT / "docs" / "data" / "phantom-demo"
OUT = ROOT / "docs" / "figures" / "phantom-clipping.png"
WINDOW = 10  # steps in the trailing mean: one step's 64 completions are a noisy estimate
KEPT = ("step", "reward/mean", "clip/frac", "clip/phantom_frac", "clip/alpha_frac",
        "mismatch/beta_abs_mean")


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """The metric's trailing mean over WINDOW steps, against the step."""
    steps = np.array([r["step"] for r in rows], dtype=float)
    values = np.array([r[key] for r in rows], dtype=float)
    kernel = np.ones(WINDOW) / WINDOW
    return steps[WINDOW - 1:], np.convolve(values, kernel, mode="valid")


def draw(stall: list[dict], fix: list[dict], out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(*series(stall, "reward/mean"), color="C3", label="bf16 engine, fp32 trainer")
    left.plot(*series(fix, "reward/mean"), color="C2", label="the same, β out of the ratio "
                                                             "(--recipe bf16-shadow)")
    left.set_title("reward, with and without β in the ratio")
    left.set_ylabel(f"reward ({WINDOW}-step mean)")
    left.set_ylim(0.0, max(1.0, left.get_ylim()[1]))  # room below the curves for the legend
    left.legend(fontsize=8, loc="lower right")

    steps, clipped = series(stall, "clip/frac")
    _, phantom = series(stall, "clip/phantom_frac")
    right.fill_between(steps, 0, 100 * (clipped - phantom), color="C0", alpha=0.5,
                       label="clipped by the policy's change (real)")
    right.fill_between(steps, 100 * (clipped - phantom), 100 * clipped, color="C3", alpha=0.5,
                       label="clipped by precision alone (phantom)")
    fix_steps, fix_clipped = series(fix, "clip/frac")
    right.plot(fix_steps, 100 * fix_clipped, color="C2", label="clipped with β out of the ratio")
    right.set_title("where the bf16 engine's clipping comes from")
    right.set_ylabel(f"% of tokens clipped ({WINDOW}-step mean)")
    right.legend(fontsize=8, loc="upper right")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle("arith on the CPU testbed, ε = 0.0013, seed 0: the runs of `parity sweep --task "
                 "arith --recipes bf16-engine,bf16-shadow ...` (README.md)", fontsize=9, y=0.03)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stall", type=Path, help="the bf16-engine run (default: the committed one)")
    ap.add_argument("--fix", type=Path, help="the bf16-shadow run (default: the committed one)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the runs' figures in docs/data/phantom-demo/")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    stall = a.stall / "metrics.jsonl" if a.stall else DATA / "stall.jsonl"
    fix = a.fix / "metrics.jsonl" if a.fix else DATA / "fix.jsonl"
    runs = {"stall": load_metrics(stall), "fix": load_metrics(fix)}
    if a.keep:
        DATA.mkdir(parents=True, exist_ok=True)
        for name, rows in runs.items():
            (DATA / f"{name}.jsonl").write_text(
                "".join(json.dumps({k: r[k] for k in KEPT}) + "\n" for r in rows))
    print(draw(runs["stall"], runs["fix"], a.out))


if __name__ == "__main__":
    main()
