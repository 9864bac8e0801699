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
  three forwards, and every op's output compared (parity/models/trace.py names the points):
      trainer      the trainer's model in the trainer's precision: the reference
      precision    the trainer's own model in the engine's dtype, with the trainer's kernels
      engine       the engine's own forward (`Engine.trace`)
  Per point, each token's relative error ‖x − x_ref‖ / ‖x_ref‖, its median and max over
  tokens, for engine and precision against the trainer and for engine against precision. The
  first point where the engine's output differs at all from precision's is where the engine's
  kernels, not its precision, part from the trainer's: that layer and op are named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from parity import metric_names as mn
from parity.models import trace as tr
from parity.models.forward import pieces, score_pieces, score_right_padded
from parity.models.precision import autocast, fp16_kernels, low_precision_copy

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
                                      "(the engine's kernels)"}


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
            cpu_fp16: str, chunk: int, rows: int) -> None:
        """Score the batch `r` again with its padding on the right, and its first `rows`
        completions one at a time; add Δℓ against the audit's `logp_pi` (the trainer's) and
        `logp_s` (the shadow's) on the tokens of `mask`."""
        dev = logp_pi.device
        first = slice(0, min(rows, r.completion_ids.shape[0]))
        sides = [("trainer", logp_pi, model, autocast(self.trainer_dtype, dev, cpu_fp16))]
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
    """Per point both traces hold, each token's ‖x − ref‖ / ‖ref‖ in float64 ([tokens])."""
    out = {}
    for point, r in ref.items():
        if point in x and x[point].shape == r.shape:
            d = (x[point].double() - r.double()).norm(dim=-1)
            n = r.double().norm(dim=-1)
            out[point] = torch.where(n > 0, d / n.clamp(min=1e-300), d)
    return out


@dataclass
class Located:
    """Per comparison and point, every traced token's relative error."""
    points: list[str]
    errors: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)

    def add(self, comparison: str, errs: dict[str, torch.Tensor]) -> None:
        into = self.errors.setdefault(comparison, {})
        for point, e in errs.items():
            into.setdefault(point, []).append(e)

    def curve(self, comparison: str) -> dict[str, list[float | int | None]]:
        """Median and max over tokens at each point (None where the point was not traced, or
        no token's error there is finite), and the tokens whose error is not: an fp16 forward
        can overflow, and a figure stays a number."""
        errs = self.errors.get(comparison, {})
        med, mx, bad = [], [], []
        for p in self.points:
            e = torch.cat(errs[p]) if p in errs else torch.zeros(0)
            ok = e[torch.isfinite(e)]
            med.append(float(ok.median()) if ok.numel() else None)
            mx.append(float(ok.max()) if ok.numel() else None)
            bad.append(int(e.numel() - ok.numel()))
        return {"median": med, "max": mx, "non_finite": bad}


def first_difference(located: Located) -> str | None:
    """The first point, in forward order, where the engine's output differs at all from the
    trainer's own model in the engine's dtype (an overflow there counts); None where they
    agree everywhere traced."""
    errs = located.errors.get("engine_vs_precision", {})
    for p in located.points:
        if p in errs and bool((torch.cat(errs[p]) != 0).any()):
            return p
    return None


def describe(point: str) -> str:
    """`layers.3.post_norm` → "layer 3's post-attention norm"."""
    names = {"embed": "the embedding", "final_norm": "the final norm", "logits": "the logits",
             "input_norm": "input norm", "attention": "attention",
             "attention_add": "residual add after attention", "post_norm": "post-attention norm",
             "mlp": "MLP", "output": "residual add after the MLP"}
    layer = tr.layer_of(point)
    if layer is None:
        return names[point]
    return f"layer {layer}'s {names[point.rsplit('.', 1)[-1]]}"


def finding(points: list[str], curves: dict[str, Any], first: str | None, engine: str,
            engine_dtype: str, trainer_dtype: str) -> str:
    """The one-line finding for `engine`, from the curves and the first point where it parts."""
    if "engine" not in curves:
        return (f"the engine was not traced ({engine}): only the precision curve, "
                f"{engine_dtype} against {trainer_dtype}, is shown")
    eng, prec = curves["engine"], curves["precision"]
    last = points.index("logits")
    at_logits = (f"; at the logits the engine is {_g(eng['median'][last])} from the "
                 f"{trainer_dtype} trainer, precision alone {_g(prec['median'][last])}")
    if first is None:
        return (f"{engine} in {engine_dtype} computes what the trainer's own model computes in "
                f"{engine_dtype} at every traced point: the gap is precision alone{at_logits}")
    i = points.index(first)
    ev = curves["engine_vs_precision"]
    return (f"{engine}'s kernels first part from the trainer's own {engine_dtype} forward at "
            f"{describe(first)} ({tr.kind(first)}): median relative error "
            f"{_g(ev['median'][i])} (max {_g(ev['max'][i])}) there, where {engine_dtype} alone "
            f"gives {_g(prec['median'][i])}{at_logits}")


def _g(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2g}"


@torch.no_grad()
def locate(model: torch.nn.Module, engine: Engine | None, a: AuditSettings,
           sequences: list[list[int]], engine_name: str) -> dict[str, Any]:
    """Trace `sequences` through the trainer, its model in the engine's dtype and (when there is
    one in this process) the engine; audit.json's `locate.layers`."""
    dev = next(model.parameters()).device
    located = Located(tr.point_names(tr.layer_count(model)))
    # The trainer's own kernels in the engine's dtype: the engine's copy, not the shadow's
    # (which attends with the engine's attention).
    prec_model = low_precision_copy(model, a.engine_dtype)
    traces = engine.trace(sequences) if engine is not None else (None for _ in sequences)
    for ids, eng in zip(sequences, traces):
        with autocast(a.trainer_dtype, dev, a.cpu_fp16):
            ref = tr.trace(model, ids)
        with fp16_kernels(a.engine_dtype, dev, a.cpu_fp16):
            prec = tr.trace(prec_model, ids)
        located.add("precision", relative_errors(prec, ref))
        if eng is not None:
            located.add("engine", relative_errors(eng, ref))
            located.add("engine_vs_precision", relative_errors(eng, prec))
    del prec_model
    curves = {c: located.curve(c) for c in COMPARISONS if c in located.errors}
    first = first_difference(located) if "engine" in located.errors else None
    return {"points": located.points, "sequences": len(sequences),
            "tokens": sum(len(s) for s in sequences), "curves": curves,
            "first_difference": first, "op": tr.kind(first) if first else None,
            "finding": finding(located.points, curves, first, engine_name, a.engine_dtype,
                               a.trainer_dtype)}


def sequences_of(r: Rollout, mask: torch.Tensor, n: int) -> Iterable[list[int]]:
    """The first `n` completions of `r` as whole token sequences, prompt then completion."""
    for b in range(min(n, r.completion_ids.shape[0])):
        p = r.prompt_ids[b][r.prompt_mask[b] > 0]
        c = r.completion_ids[b][mask[b] > 0]
        yield torch.cat([p, c]).tolist()


# What a finding at each kind of op suggests (docs/diagnostics.md, Where the gap comes from).
SUGGEST = {"embedding": "the engine's embedding differs: check that it holds the trainer's "
                        "weights (a sync that did not reach it)",
           "norm": "match the norm's casts: normalise in fp32, cast to the weight's dtype, then "
                   "multiply by the weight, as transformers does",
           "attention": "the same attention kernel and split on both sides, and RoPE in fp32 "
                        "on both (or the engine scores the shadow: --shadow-kernels scored)",
           "MLP": "the same matmul kernels at the same shapes (batch-invariant kernels, the "
                  "same tensor-parallel degree)",
           "residual add": "the residual add in the same dtype on both sides (vLLM fuses it into "
                           "the next norm)",
           "head": "an fp32 LM head on both sides (--lm-head-fp32 for parity's engine)"}


def advice(result: dict[str, Any]) -> list[str]:
    """The advice's lines from --locate's figures: how much of β the trainer has with itself,
    and what the first op where the engine parts suggests."""
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
    layers = loc.get("layers") or {}
    op = layers.get("op")
    if op:
        where = describe(layers["first_difference"])
        out.append(f"where the engine parts from the trainer: {where} ({op}); {SUGGEST[op]}")
    elif "engine" in layers.get("curves", {}):
        out.append("the engine computes what the trainer's own model computes in its dtype at "
                   "every traced op: the gap is precision alone (fp16, or a recipe that takes "
                   "β out of the ratio)")
    return out
