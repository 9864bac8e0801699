"""A mixture of experts' routing in an audit, for readers: its lines in the terminal and its part
of report.html (the flip share by layer as a plot, β on tokens with and without a flip)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from parity import metric_names as mn
from parity.reports import Heading, finish
from parity.reports import Table as PageTable


def by_layer(m: dict[str, Any]) -> list[float]:
    """The flip share of each MoE layer, in layer order."""
    out, j = [], 0
    while (key := mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j)) in m:
        out.append(m[key])
        j += 1
    return out


def lines(m: dict[str, Any]) -> list[str]:
    """What the routing figures say, a line each; none for a dense model."""
    if mn.ROUTING_FLIP_FRAC not in m:
        return []
    layers = by_layer(m)
    worst = max(range(len(layers)), key=layers.__getitem__)
    out = [f"routing: {m[mn.ROUTING_FLIP_FRAC]:.2%} of router decisions flipped (MoE layer "
           f"{worst} most: {layers[worst]:.2%}), {m.get(mn.ROUTING_TOKEN_FLIP_FRAC, 0):.2%} of "
           f"tokens with a flip"]
    if mn.ROUTING_BETA_ABS_FLIPPED in m:
        out.append(f"  mean |beta| {m[mn.ROUTING_BETA_ABS_FLIPPED]:.3g} on tokens with a flip, "
                   f"{m.get(mn.ROUTING_BETA_ABS_UNFLIPPED, float('nan')):.3g} without; "
                   f"margin at the flips {m.get(mn.ROUTING_MARGIN_AT_FLIPS, float('nan')):.3g} "
                   f"of a router logit (mean {m[mn.ROUTING_MARGIN_MEAN]:.3g})")
    if mn.ROUTING_KL_K3_FLIPPED_SHARE in m:
        out.append(f"  the flipped tokens carry {m[mn.ROUTING_KL_K3_FLIPPED_SHARE]:.1%} of KL k3"
                   + (f" and {m[mn.ROUTING_PHANTOM_FLIPPED_SHARE]:.1%} of the phantom clips"
                      if mn.ROUTING_PHANTOM_FLIPPED_SHARE in m else "")
                   + "; `--routing-replay` trains on the engine's experts (docs/moe.md)")
    return out


def print_routing(result: dict[str, Any], console: Any) -> None:
    for line in lines(result["metrics"]):
        console.print(line, highlight=False)


def routing_sections(result: dict[str, Any], out: Path) -> list[Any]:
    """report.html's part for a mixture of experts: empty for a dense model."""
    m = result["metrics"]
    if mn.ROUTING_FLIP_FRAC not in m:
        return []
    layers = by_layer(m)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(layers)), [100 * v for v in layers], color="tab:orange",
           label=f"{result['completions']} sampled completions")
    ax.set_xticks(range(len(layers)))
    plot = finish(fig, ax, out / "routing.png", alt="share of router decisions flipped by layer",
                  xlabel="MoE layer", ylabel="decisions flipped (%)",
                  title="where the trainer's routers chose other experts than the engine's")
    rows = [[name.split("/", 1)[1], m.get(name)] for name in (
        mn.ROUTING_FLIP_FRAC, mn.ROUTING_TOKEN_FLIP_FRAC, mn.ROUTING_BETA_ABS_FLIPPED,
        mn.ROUTING_BETA_ABS_UNFLIPPED, mn.ROUTING_MARGIN_AT_FLIPS, mn.ROUTING_MARGIN_MEAN,
        mn.ROUTING_KL_K3_FLIPPED_SHARE, mn.ROUTING_PHANTOM_FLIPPED_SHARE)]
    return [Heading("Routing (a mixture of experts)"), *lines(m), plot,
            PageTable(["figure", "value"], rows, caption="docs/moe.md defines each")]
