"""`parity audit --locate`: where the engine–trainer gap comes from.

Two passes beside the audit's own (docs/diagnostics.md, "Where the gap comes from"):

- The trainer against itself (`SelfGap`). The audit's first batch of completions (one
  micro-batch, its prompts padded on the left, as the audit scores it) scored again by the same
  trainer on the same weights: the whole batch with its padding on the right, and its first
  completions one at a time (micro-batch 1); in the trainer's precision (ℓ_π) and in the
  engine's (the shadow, ℓ_s). Δℓ = ℓ(other layout) − ℓ(audit's layout): a gap no engine recipe
  can remove. One batch, because the figures are shares of thousands of tokens and each
  completion alone is a forward of its own.
- The gap located (`locate`). A few completions, prompt and completion as one sequence, through
  four forwards, and every op's output compared (parity/models/trace.py names the points):
      trainer      the trainer's model in the trainer's precision: the reference
      precision    the trainer's own model in the engine's dtype, with the trainer's kernels
      engine       the engine's own forward of the whole sequence (`Engine.trace`)
      decode       the engine's decode step of the last token against its KV cache
                   (`Engine.trace_decode`)
  Per point, each token's relative error ‖x − x_ref‖ / ‖x_ref‖, its median and max over
  tokens, for each comparison of `COMPARISONS`; at the logits also the sampled tokens' |Δℓ|
  and the KL, which a shift common to the vocabulary does not move. The point named is where
  the engine's error rises above precision's (parity/audit/finding.py); a point an engine's
  trace lacks is listed as not traced and claims nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from parity import metric_names as mn
from parity.audit import finding as fd
from parity.errors import ParityError
from parity.models import routing
from parity.models import trace as tr
from parity.models.forward import pieces, score_pieces, score_right_padded
from parity.models.precision import fp16_kernels, low_precision_copy, trainer_precision

if TYPE_CHECKING:
    from parity.config import AuditSettings
    from parity.diagnostics import Shadow
    from parity.engines import Engine
    from parity.logprobs import Rollout, Sampling

# The measure users quote for a trainer against itself: tokens whose ratio leaves about
# [0.9, 1.1], |Δℓ| > 0.1.
OUTSIDE = 0.1
# The trainer's own gap is worth acting on from this share of mean |β|.
SELF_GAP_SHARE = 0.1
CHANGES = {"batch_1": "micro-batch 1 against the audit's micro-batch",
           "right_pad": "padding on the right against the left"}
COMPARISONS = {"engine": "engine against the trainer",
               "precision": "the trainer's model in engine dtype against the trainer "
                            "(precision alone)",
               "engine_vs_precision": "engine against the trainer's model in engine dtype "
                                      "(the engine's kernels)",
               "decode": "the engine's decode step against the trainer, at the last token",
               "decode_vs_prefill": "the engine's decode step against its own prefill, at the "
                                    "last token"}


# ---- the trainer against itself ------------------------------------------------------------

@dataclass
class _Pair:
    n: int = 0
    abs_sum: float = 0.0
    outside: int = 0
    abs_max: float = 0.0

    def add(self, delta: torch.Tensor) -> None:
        d = delta.double().abs()
        self.n += d.numel()
        self.abs_sum += float(d.sum())
        self.outside += int((d > OUTSIDE).sum())
        self.abs_max = max(self.abs_max, float(d.max())) if d.numel() else self.abs_max


@dataclass
class SelfGap:
    """Δℓ of the trainer against itself over the audited completions, per forward and change."""
    trainer_dtype: str
    engine_dtype: str
    pairs: dict[tuple[str, str], _Pair] = field(default_factory=dict)
    note: str = ""

    @torch.no_grad()
    def add(self, model: torch.nn.Module, shadow: Shadow, r: Rollout, s: Sampling,
            logp_pi: torch.Tensor, logp_s: torch.Tensor, mask: torch.Tensor,
            cpu_fp16: str, chunk: int, rows: int, kernels: str = "default") -> None:
        """Score the batch `r` again with its padding on the right, and its first `rows`
        completions one at a time; add Δℓ against the audit's `logp_pi` (the trainer's) and
        `logp_s` (the shadow's) on the tokens of `mask`."""
        dev = logp_pi.device
        first = slice(0, min(rows, r.completion_ids.shape[0]))
        sides = [("trainer", logp_pi, model,
                  trainer_precision(self.trainer_dtype, dev, cpu_fp16, kernels, model))]
        if shadow.model is not None:
            sides.append(("shadow", logp_s, shadow.model,
                          fp16_kernels(shadow.dtype, dev, cpu_fp16)))
        elif shadow.engine is not None:
            self.note = "the shadow is scored by the engine itself: its rows are absent"
        else:
            self.note = "the shadow is the trainer's own forward (fp32 on both sides)"
        alone = r.select(first)
        for side, ref, m, ctx in sides:
            with ctx:
                other = {"batch_1": (score_pieces(m, alone, s, pieces(alone, rows=1),
                                                  chunk=chunk).logp, first),
                         "right_pad": (score_right_padded(m, r, s), slice(None))}
            for change, (logp, sl) in other.items():
                ok = (mask[sl] > 0) & torch.isfinite(logp) & torch.isfinite(ref[sl])
                self.pairs.setdefault((side, change), _Pair()).add((logp - ref[sl])[ok])

    def results(self) -> list[dict[str, Any]]:
        dtype = {"trainer": self.trainer_dtype, "shadow": self.engine_dtype}
        return [{"forward": side, "dtype": dtype[side], "change": change, "tokens": p.n,
                 "abs_mean": p.abs_sum / p.n if p.n else None,
                 "abs_max": p.abs_max if p.n else None,
                 "frac_outside": p.outside / p.n if p.n else None}
                for (side, change), p in self.pairs.items()]


# ---- the gap located -----------------------------------------------------------------------

def relative_errors(x: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """Per point both traces hold at the same shape, each token's ‖x − ref‖ / ‖ref‖ in float64
    ([tokens]); a point either lacks is absent (`Located` counts it as not traced)."""
    out = {}
    for point, r in ref.items():
        if point in x and x[point].shape == r.shape:
            d = (x[point].double() - r.double()).norm(dim=-1)
            n = r.double().norm(dim=-1)
            out[point] = torch.where(n > 0, d / n.clamp(min=1e-300), d)
    return out


def last_row(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trace at its last token: what a decode step of that token computes."""
    return {p: x[-1:] for p, x in t.items()}


@dataclass
class Located:
    """Per comparison and point, every traced token's relative error; the points the
    reference (the trainer's trace) holds; and per comparison the points some trace lacked."""
    points: list[str] = field(default_factory=list)
    errors: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    lacked: dict[str, set[str]] = field(default_factory=dict)
    logit_rows: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    router_flips: dict[int, list[int]] = field(default_factory=dict)   # layer: [flips, tokens]

    def flips(self, x: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], k: int) -> None:
        """Per MoE layer, the tokens whose top-k experts by `x`'s router logits are not
        `ref`'s."""
        for p in x:
            if k and p.endswith(".router") and p in ref and x[p].shape == ref[p].shape:
                d = routing.decisions_differ(x[p].topk(k, -1).indices[:, None],
                                             ref[p].topk(k, -1).indices[:, None])
                tally = self.router_flips.setdefault(tr.layer_of(p), [0, 0])
                tally[0] += int(d.sum())
                tally[1] += d.numel()

    def add(self, comparison: str, errs: dict[str, torch.Tensor],
            expected: Iterable[str] | None = None) -> None:
        into = self.errors.setdefault(comparison, {})
        lacked = self.lacked.setdefault(comparison, set())
        for point in (self.points if expected is None else expected):
            if point in errs:
                into.setdefault(point, []).append(errs[point])
            else:
                lacked.add(point)

    def joined(self, comparison: str) -> dict[str, torch.Tensor]:
        """Each point's errors over every token, where every trace held the point."""
        lacked = self.lacked.get(comparison, set())
        return {p: torch.cat(e) for p, e in self.errors.get(comparison, {}).items()
                if p not in lacked}

    def missing(self, comparison: str) -> list[str]:
        lacked = self.lacked.get(comparison, set())
        return [p for p in self.points if p in lacked]

    def curve(self, comparison: str) -> dict[str, list[float | int | None]]:
        """Median and max over tokens at each point (None where the point was not traced, or
        no token's error there is finite), and the tokens whose error is not: an fp16 forward
        can overflow, and a figure stays a number."""
        errs = self.joined(comparison)
        med, mx, bad = [], [], []
        for p in self.points:
            e = errs.get(p, torch.zeros(0))
            ok = e[torch.isfinite(e)]
            med.append(float(ok.median()) if ok.numel() else None)
            mx.append(float(ok.max()) if ok.numel() else None)
            bad.append(int(e.numel() - ok.numel()))
        return {"median": med, "max": mx, "non_finite": bad}

    def logits(self, comparison: str, x: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
               ids: list[int] | None, start: int) -> None:
        """At the logits, what changes a log-prob: the sampled tokens' |Δℓ| (the tokens from
        `start` on, each predicted by the position before it; none without `ids`) and the KL
        of the reference's distribution to x's at those positions, in float64."""
        if "logits" not in x or "logits" not in ref or x["logits"].shape != ref["logits"].shape:
            return
        rows = slice(start - 1, len(ids) - 1) if ids is not None else slice(None)
        lx = torch.log_softmax(x["logits"][rows].double(), -1)
        lr = torch.log_softmax(ref["logits"][rows].double(), -1)
        p = lr.exp()   # a token the reference gives no mass adds nothing, whatever x gives it
        kl = torch.where(p > 0, p * (lr - lx), torch.zeros_like(p)).sum(-1)
        dl = None
        if ids is not None:
            nxt = torch.tensor(ids[start:], device=lx.device)[:, None]
            dl = (lx.gather(-1, nxt) - lr.gather(-1, nxt)).squeeze(-1).abs()
        # A position whose logits overflowed (an fp16 forward) gives no figure: left out, counted.
        ok = torch.isfinite(kl) & (torch.isfinite(dl) if dl is not None else True)
        into = self.logit_rows.setdefault(comparison, {})
        into.setdefault("kl", []).append(kl[ok])
        into.setdefault("left_out", []).append(torch.tensor([int((~ok).sum())]))
        if dl is not None:
            into.setdefault("dlogp", []).append(dl[ok])

    def logit_summary(self) -> dict[str, dict[str, float | int | None]]:
        out = {}
        for c, rows in self.logit_rows.items():
            kl = torch.cat(rows["kl"])
            dl = torch.cat(rows["dlogp"]) if "dlogp" in rows else torch.zeros(0)
            out[c] = {"tokens": int(kl.numel()),
                      "kl_mean": float(kl.mean()) if kl.numel() else None,
                      "abs_dlogp_mean": float(dl.mean()) if dl.numel() else None,
                      "abs_dlogp_max": float(dl.max()) if dl.numel() else None,
                      "left_out": int(torch.cat(rows["left_out"]).sum())}
        return out


def first_difference(located: Located) -> str | None:
    """The first point, in forward order, where the engine's output differs at all from the
    trainer's own model in the engine's dtype (an overflow there counts); None where they
    agree everywhere traced."""
    errs = located.joined("engine_vs_precision")
    for p in located.points:
        if p in errs and bool((errs[p] != 0).any()):
            return p
    return None


def check_traceable(model: torch.nn.Module) -> None:
    """--locate follows the trainer's model layer by layer: refused, before anything is
    sampled, where its layers cannot be found."""
    try:
        tr.decoder(model)
    except ValueError as e:
        raise ParityError(f"--locate: {e}; the trace knows the Llama, Qwen and GPT-2 "
                          f"families' layers") from None


@torch.no_grad()
def locate(model: torch.nn.Module, engine: Engine | None, a: AuditSettings,
           sequences: list[list[int]], engine_name: str, starts: list[int] | None = None,
           sampled_flips: list[float] | None = None) -> dict[str, Any]:
    """Trace `sequences` through the trainer, its model in the engine's dtype and (when there is
    one in this process) the engine, prefill and decode; audit.json's `locate.layers`. A
    sequence's completion starts at `starts` (1: every token after the first is scored).
    `sampled_flips`: a mixture of experts' flip share by MoE layer (in router order) over the
    audit's sampled completions, as the engine routed them while decoding
    (parity/runs/routing_gap.py): far more tokens than the traced sequences, and the decode's
    own routing."""
    dev = next(model.parameters()).device
    layers = tr.layer_count(model)
    located = Located()
    # The trainer's own kernels in the engine's dtype: the engine's copy, not the shadow's
    # (which attends with the engine's attention).
    prec_model = low_precision_copy(model, a.engine_dtype)
    none = itertools.repeat(None)
    top_k = routing.shape(model)[2] if routing.is_moe(model) else 0
    traces = engine.trace(sequences) if engine is not None else none
    decodes = engine.trace_decode(sequences) if engine is not None else none
    for ids, start, eng, dec in zip(sequences, starts or [1] * len(sequences), traces, decodes):
        with trainer_precision(a.trainer_dtype, dev, a.cpu_fp16, a.kernels, model):
            ref = tr.trace(model, ids)
        with fp16_kernels(a.engine_dtype, dev, a.cpu_fp16):
            prec = tr.trace(prec_model, ids)
        if not located.points:
            located.points = tr.in_order(ref, layers)
        located.add("precision", relative_errors(prec, ref))
        located.add("precision_last", relative_errors(last_row(prec), last_row(ref)))
        located.logits("precision", prec, ref, ids, start)
        if eng is not None:
            located.flips(eng, ref, top_k)
            located.add("engine", relative_errors(eng, ref))
            located.add("engine_vs_precision", relative_errors(eng, prec))
            located.logits("engine", eng, ref, ids, start)
        if dec is not None:
            located.add("decode", relative_errors(dec, last_row(ref)))
            located.add("decode_vs_prefill", relative_errors(dec, last_row(eng or {})))
            located.logits("decode", dec, last_row(ref), None, 0)
    del prec_model
    curves = {c: located.curve(c) for c in (*COMPARISONS, "precision_last")
              if c in located.errors}
    traced = "engine" in located.errors
    flips = {layer: f / n for layer, (f, n) in sorted(located.router_flips.items())}
    sampled = dict(zip(routing.layer_ids(model), sampled_flips or []))
    named = _named(located, sampled or flips, model, bool(sampled)) if traced else None
    first = first_difference(located) if traced else None
    out = {"points": located.points, "sequences": len(sequences),
           "tokens": sum(len(s) for s in sequences), "curves": curves,
           "missing": {c: located.missing(c) for c in located.errors},
           "logits": located.logit_summary(), "named": named, "router_flips": flips,
           "router_flips_sampled": sampled,
           "op": named["op"] if named else None, "first_difference": first,
           "engine_dtype": a.engine_dtype, "trainer_dtype": a.trainer_dtype}
    out["finding"] = fd.finding(out, engine_name, a.engine_dtype, a.trainer_dtype)
    out["details"] = fd.details(out)
    return out


def _named(located: Located, flips: dict[int, float], model: torch.nn.Module, sampled: bool
           ) -> dict[str, Any] | None:
    """The op a finding names: the first MoE layer whose router chose other experts (a flipped
    expert moves a token more than any kernel, and every layer after it sees the move;
    `sampled`: the flips of the sampled completions' decode, else the traced prefill's), else
    the first point whose error rises above precision's, in the prefill, then in the decode
    step."""
    hit = next(((layer, share) for layer, share in flips.items() if share > 0), None)
    if hit is not None:
        return {"point": f"layers.{hit[0]}.router", "op": "router",
                "pass": "sampled decode" if sampled else "prefill", "flip_frac": hit[1],
                "top_k": routing.shape(model)[2], "ratio": None, "low": None}
    for what, errs, yard in (("prefill", "engine", "precision"),
                             ("decode", "decode", "precision_last")):
        rose = fd.first_rise(located.points, located.joined(errs), located.joined(yard))
        if rose is not None:
            point, r = rose
            return {"point": point, "op": tr.kind(point), "pass": what, **r}
    return None


def sequences_of(r: Rollout, mask: torch.Tensor, n: int) -> Iterable[tuple[list[int], int]]:
    """The first `n` completions of `r` as whole token sequences, prompt then completion, each
    with where its completion starts."""
    for b in range(min(n, r.completion_ids.shape[0])):
        p = r.prompt_ids[b][r.prompt_mask[b] > 0]
        c = r.completion_ids[b][mask[b] > 0]
        yield torch.cat([p, c]).tolist(), int(p.numel())


def advice(result: dict[str, Any]) -> list[str]:
    """The advice's lines from --locate's figures: how much of β the trainer has with itself,
    and where the engine's kernels matter, or that precision is the cause."""
    loc = result.get("locate")
    if not loc:
        return []
    out = []
    beta = result["metrics"].get(mn.BETA_ABS_MEAN)
    worst = max((r for r in loc["self_gap"] if r["abs_mean"] is not None),
                key=lambda r: r["abs_mean"], default=None)
    if worst is not None and beta:
        said = (f"the trainer against itself ({worst['forward']}, {worst['dtype']}, "
                f"{CHANGES[worst['change']]}): mean |Δℓ| {worst['abs_mean']:.3g}, "
                f"{worst['abs_mean'] / beta:.0%} of mean |β|, {worst['frac_outside']:.1%} of "
                f"tokens beyond {OUTSIDE}")
        out.append(said + (": no engine recipe removes that part; keep one micro-batch and "
                           "padding for ℓ_old and ℓ_π, or train in fp32"
                           if worst["abs_mean"] >= SELF_GAP_SHARE * beta
                           else ": the gap is not the trainer's own"))
    line = fd.advice(loc["layers"]) if loc.get("layers") else None
    return out + ([line] if line else [])
