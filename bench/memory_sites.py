"""Where a process's GPU memory is at its peak, by allocation site, from torch's allocator
history (`torch.cuda.memory._record_memory_history`).

    record()                 # before the model loads: every allocation from here keeps its stack
    ...                      # the work
    rows = at_peak(top=15)   # the live blocks at the allocator's peak, grouped by site

The history is replayed event by event to the moment the allocated total was highest; the
blocks alive then are grouped by their site: the innermost frame outside torch's own package
(the model's layer, the optimizer, vLLM's cache, ...), with the innermost frame of parity, TRL
or vLLM above it (`via`). Blocks allocated before `record` have no stack and count as one row,
and so do those allocated by the autograd engine's own threads, which have no Python stack
("torch internals": gradients and the backward's buffers).
The summary is computed where the GPU is: a snapshot of a training run is hundreds of MB.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

MAX_ENTRIES = 1_000_000
_OWN = ("/parity/", "/trl/", "/vllm/", "/bench/")


def record() -> None:
    import torch
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")


def _where(frames: list[dict]) -> tuple[str, str]:
    def name(f: dict) -> str:
        path = f["filename"]
        for root in ("site-packages/", "dist-packages/", "/work/", "/tmp/site/", "/.cache/"):
            if root in path:
                path = path.split(root, 1)[1]
        return f"{path}:{f['line']} {f['name']}"
    site = next((f for f in frames if "/torch/" not in f["filename"]
                 and not f["filename"].startswith("<")), None)
    # the innermost frame of parity, TRL or vLLM above the site: what asked for the work
    own = [f for f in frames if any(k in f["filename"] for k in _OWN) and f is not site]
    return (name(site) if site else "torch internals", name(own[0]) if own else "")


def at_peak(top: int = 15) -> dict[str, Any]:
    """This process's sites at its peak (`sites_at_peak`), and the recording stopped."""
    import torch
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return sites_at_peak(snap, torch.cuda.current_device(), top)


def sites_at_peak(snap: dict, device: int, top: int) -> dict[str, Any]:
    """{'peak_gib', 'rows': [{'site', 'via', 'gib', 'blocks'}], 'rest_gib'} from a snapshot in
    torch's format (`torch.cuda.memory._snapshot()`)."""
    events = [e for e in snap["device_traces"][device]
              if e["action"] in ("alloc", "free_completed")]
    # Blocks alive when the history starts: the snapshot's blocks, minus those the history
    # allocated since (they are replayed), plus those it freed since.
    first: dict[int, dict] = {}
    for e in events:
        first.setdefault(e["addr"], e)
    base = {b["address"]: b["size"] for seg in snap["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated" and b["address"] not in first}
    base.update({a: e["size"] for a, e in first.items() if e["action"] == "free_completed"})
    total = peak = sum(base.values())
    at = -1
    for i, e in enumerate(events):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > peak:
            peak, at = total, i
    live: dict[int, tuple[int, tuple[str, str]]] = {a: (s, ("allocated before recording", ""))
                                                    for a, s in base.items()}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
        else:
            live.pop(e["addr"], None)
    sites: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for size, key in live.values():
        sites[key][0] += size
        sites[key][1] += 1
    rows = sorted(sites.items(), key=lambda kv: -kv[1][0])
    gib = 2 ** 30
    return {"peak_gib": peak / gib,
            "rows": [{"site": s, "via": v, "gib": b / gib, "blocks": n}
                     for (s, v), (b, n) in rows[:top]],
            "rest_gib": sum(b for _, (b, _) in rows[top:]) / gib}
