"""Training with the `bitwise` recipe beside fp32 and bf16-shadow, from the same seeds: every
step's gap figures and the learning curves (docs/zero-mismatch.md).

    python -m bench.zero_mismatch_runs [--model text-xs] [--seeds 0,1,2] [--steps 30] \
        [--out /tmp/zero-runs] [--plot docs/figures/zero-mismatch-curves.png]

The runs are one `parity sweep` (its own processes, rerun-safe: finished runs are kept). The
table holds, per run, the reward at step 1 and over the last 5 steps, and the largest of each
gap figure over every step: for bitwise, exactly 0 wherever its kernels held.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import ROOT, Table, json_option, publish
from parity import metric_names as mn

RECIPES = ("fp32", "bf16-shadow", "bitwise")
GAP = (mn.BETA_ABS_MAX, mn.KL_K3, mn.KL_EXACT, mn.KERNEL_GAP_ABS_MEAN, mn.PHANTOM_FRAC)


def sweep(a: argparse.Namespace) -> None:
    from parity.cli import main
    code = main(["sweep", "--recipes", ",".join(RECIPES), "--seeds", a.seeds, "--models",
                 a.model, "--tasks", "neg-length", "--steps", str(a.steps), "--out", a.out,
                 "--no-progress"])
    if code:
        raise SystemExit(f"the sweep failed ({code})")


def runs(a: argparse.Namespace) -> dict[tuple[str, int], list[dict]]:
    out = {}
    for recipe in RECIPES:
        for seed in map(int, a.seeds.split(",")):
            d = Path(a.out) / "runs" / f"neg-length-{Path(a.model).name}-{recipe}-s{seed}"
            out[recipe, seed] = [json.loads(x) for x in
                                 (d / "metrics.jsonl").read_text().splitlines()]
    return out


def table(rows: dict[tuple[str, int], list[dict]], a: argparse.Namespace) -> Table:
    t = Table("zero_mismatch_runs",
              f"{a.model}, neg-length, {a.steps} steps a run; reward at step 1 and over the "
              f"last 5 steps, then each gap figure's largest value over every step",
              [("recipe", None), ("seed", "{}"), ("reward step 1", "{:.2f}"),
               ("reward last 5", "{:.2f}"), *[(k.split("/")[-1], "{:.3g}") for k in GAP]])
    for (recipe, seed), steps in rows.items():
        last = [s[mn.REWARD_MEAN] for s in steps[-5:]]
        t.add(recipe, seed, steps[0][mn.REWARD_MEAN], sum(last) / len(last),
              *[max((s[k] for s in steps if s.get(k) is not None), default=None) for k in GAP])
    return t


def plot(rows: dict[tuple[str, int], list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from parity.reports import finish
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = dict(zip(RECIPES, ("tab:gray", "tab:blue", "tab:red")))
    for (recipe, seed), steps in rows.items():
        ax.plot([s[mn.STEP] for s in steps], [s[mn.REWARD_MEAN] for s in steps],
                color=colours[recipe], alpha=0.8, lw=1.2,
                label=recipe if seed == min(s for r, s in rows if r == recipe) else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    finish(fig, ax, path, "neg-length's reward by step", xlabel="step",
           ylabel="reward (minus the completion length)",
           title="neg-length: bitwise beside fp32 and bf16-shadow, same seeds")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="text-xs")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="/tmp/zero-runs")
    # relative to the repository: the bench file records its arguments
    ap.add_argument("--plot", default="docs/figures/zero-mismatch-curves.png")
    a = json_option(ap, "zero_mismatch_runs").parse_args()
    sweep(a)
    rows = runs(a)
    publish("zero_mismatch_runs", [table(rows, a)], a)
    if a.plot:
        plot(rows, ROOT / a.plot)


if __name__ == "__main__":
    main()
