"""A mixture-of-experts model's routing: which experts each token's router chose in every MoE
layer, recorded as a forward runs; the trainer's choice compared with the engine's; and Rollout
Routing Replay (R3), where a forward takes the experts the engine chose.

transformers' MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) route with a router module
whose forward maps hidden states [N, d] to (router logits [N, E], gate weights [N, k], expert ids
[N, k]), with `top_k` and `num_experts` on it. That module is the one place routing happens, so
recording and replay wrap its forward and nothing else (docs/moe.md).

Layout: a forward over ids [B, S] routes B·S positions in row-major order, so a record is
[B, S, L, k] over L MoE layers. An id of `num_experts` (no router gives it) marks a position
whose experts are unknown (the last sampled token, never fed back): replay routes it itself.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from parity.errors import ParityError


def _is_router(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (isinstance(getattr(m, "top_k", None), int) and isinstance(getattr(m, "num_experts",
            None), int) and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.shape[0] == m.num_experts)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order, each with parity's hook (registered once; it does
    nothing outside `recording` and `replaying`). Empty for a dense model. The hook keeps its
    state on the router itself, so a copy of the model (the engine's, the shadow's) routes on
    its own."""
    found = model.__dict__.get("_parity_routers")
    if found is None:
        found = []
        for name, m in model.named_modules():
            if _is_router(m):
                layer = re.search(r"layers\.(\d+)\.", name)
                m._parity_layer = int(layer.group(1)) if layer else len(found)
                m._parity_record, m._parity_replay = None, None
                found.append(m)
        model.__dict__["_parity_routers"] = found
    for m in found:   # a copy made without hooks (precision.without_patches) gets its own
        if not any(h is _route for h in m._forward_hooks.values()):
            m.register_forward_hook(_route)
    return found


@contextmanager
def off(model: torch.nn.Module) -> Iterator[None]:
    """The model as if parity had never looked for its routers: no hook of parity's runs, so
    nothing is recorded or replayed inside (what the routing costs is measured against it:
    bench/moe.py). Other hooks on the routers stay; parity's come back after."""
    rs = routers(model)
    for m in rs:
        for key in [k for k, h in m._forward_hooks.items() if h is _route]:
            del m._forward_hooks[key]
    model.__dict__["_parity_routers"] = []
    try:
        yield
    finally:
        model.__dict__["_parity_routers"] = rs
        routers(model)   # registers the hooks again


def is_moe(model: torch.nn.Module) -> bool:
    return bool(routers(model))


def check_replay(model: torch.nn.Module, replay: bool, name: str) -> None:
    """Refuse routing replay for a model without routers, in one line, before a run starts."""
    if replay and not is_moe(model):
        raise ParityError(f"--routing-replay: {name} has no mixture-of-experts layers (no "
                          f"router module with top_k and num_experts) to replay")


def layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder layer of each MoE layer, in order (a model may keep dense layers between)."""
    return [m._parity_layer for m in routers(model)]


def shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(MoE layers, experts, experts per token)."""
    rs = routers(model)
    return len(rs), rs[0].num_experts, rs[0].top_k


def id_dtype(experts: int) -> torch.dtype:
    """The narrowest integer type that holds every id and, above them, the unknown mark."""
    return torch.uint8 if experts < 256 else torch.int16 if experts < 32768 else torch.int32


def unknown(experts: int) -> int:
    """The id that marks a position whose experts are unknown: the largest `id_dtype` holds
    (any id at or above the expert count is read as unknown)."""
    return torch.iinfo(id_dtype(experts)).max


def gate_weights(logits: torch.Tensor, ids: torch.Tensor, normalise: bool) -> torch.Tensor:
    """R3's gate weights: the router's softmax over all experts (fp32), at the experts `ids`
    [N, k], renormalised over them where the router renormalises its top-k. Gradient flows to
    the router's logits through the chosen experts' probabilities."""
    p = torch.softmax(logits.float(), dim=-1).gather(-1, ids.long())
    return p / p.sum(-1, keepdim=True) if normalise else p


def margin(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N] fp32: the k-th largest router logit minus the (k+1)-th: how near the choice is to a
    tie (0: tied, the order of the sums decides)."""
    top = logits.detach().float().topk(min(k + 1, logits.shape[-1]), dim=-1).values
    return top[:, k - 1] - top[:, k] if top.shape[-1] > k else torch.full_like(top[:, 0], 1e30)


def _route(m: torch.nn.Module, args: tuple, out: tuple) -> tuple | None:
    logits, scores, ids = out
    if m._parity_record is not None:
        m._parity_record.append((ids.detach(), margin(logits, ids.shape[-1])))
    want, m._parity_replay = m._parity_replay, None
    if want is None:
        return None
    want = want.to(ids.device)
    if want.shape != ids.shape:
        raise ValueError(f"routing replay: layer {m._parity_layer} routes {tuple(ids.shape)} "
                         f"positions x experts, the record holds {tuple(want.shape)}")
    want = torch.where(want >= m.num_experts, ids, want.long())
    normalise = getattr(m, "norm_topk_prob", True)   # Mixtral's router always renormalises
    return logits, gate_weights(logits, want, normalise).to(scores.dtype), want


@dataclass
class Recorded:
    """The routing of every forward inside `recording`, per layer."""
    layers: list[list]     # per MoE layer: (own ids [N, k], margin [N]) per forward
    experts: int

    def ids(self, batch: int, forward: int = -1) -> torch.Tensor:
        """[B, S, L, k]: one forward's own choice (the last by default), in the record's
        layout."""
        return torch.stack([rec[forward][0].reshape(batch, -1, rec[forward][0].shape[-1])
                            for rec in self.layers], dim=2)

    def sequence(self, batch: int, width: int, total: int) -> torch.Tensor:
        """[B, width + total, L, k] in `id_dtype`: a decode's routing, the prefill of `width`
        prompt columns first, then one completion column per decode step; the columns no
        forward fed (the last sampled token's) hold the unknown mark."""
        first = self.ids(batch, 0)
        L, k = first.shape[2], first.shape[3]
        out = torch.full((batch, width + total, L, k), unknown(self.experts),
                         dtype=id_dtype(self.experts), device=first.device)
        out[:, :width] = first
        for t in range(1, min(len(self.layers[0]), total + 1)):
            out[:, width + t - 1] = self.ids(batch, t)[:, 0]
        return out

    def pieces(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every forward inside, each over a [b, width] batch, put back together in order:
        ids [B, width, L, k] and margins [B, width, L] of a batch scored in pieces."""
        ids = torch.stack([torch.cat([f[0].reshape(-1, width, f[0].shape[-1]) for f in rec])
                           for rec in self.layers], dim=2)
        margins = torch.stack([torch.cat([f[1].reshape(-1, width) for f in rec])
                               for rec in self.layers], dim=2)
        return ids, margins

    def margins(self, batch: int) -> torch.Tensor:
        """[B, S, L] fp32 top-k margins of the last forward."""
        return torch.stack([rec[-1][1].reshape(batch, -1) for rec in self.layers], dim=2)


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[Recorded]:
    """Each router's own choice (even under replay) and its margin, per forward inside."""
    rs = routers(model)
    for m in rs:
        m._parity_record = []
    try:
        yield Recorded([m._parity_record for m in rs], rs[0].num_experts if rs else 0)
    finally:
        for m in rs:
            m._parity_record = None


@contextmanager
def replaying(model: torch.nn.Module, ids: torch.Tensor | None) -> Iterator[None]:
    """The next forward inside routes with `ids` [B, S, L, k] (a record over the forward's
    ids [B, S]); a dense model or `ids` None changes nothing."""
    rs = routers(model) if ids is not None else []
    for j, m in enumerate(rs):
        m._parity_replay = ids[:, :, j].reshape(-1, ids.shape[-1])
    try:
        yield
    finally:
        for m in rs:
            m._parity_replay = None


def decisions_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., L] bool: the expert sets of two records [..., L, k] differ (the order within a
    top-k does not matter: the gate weights follow the experts)."""
    return (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)


def known(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """[..., L] bool: the record names this position's experts."""
    return (ids.long() < experts).all(-1)
