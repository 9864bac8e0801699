"""`parity fp16-check`: can this BF16 (or FP32) checkpoint run in FP16?

FP16 has 3 more mantissa bits than BF16 (the reason parity's `fp16` recipe shrinks the
train/infer gap) but a far smaller range: nothing beyond 65504, values below 2**-14 lose
precision as subnormals, and below 2**-24 nothing is left. A checkpoint trained in BF16 never
had to respect that range, so this check measures it instead of assuming it:

    weights       every parameter tensor of the fp32 checkpoint
    activations   every module's floating-point outputs, fp32 forward over sample prompts
    fp16 forward  the same prompts through a real fp16 copy (tensor-core numerics): inf/NaN?
    gradients     one fp32 backward of the LM loss: parameter and activation gradients against
                  fp16's range, unscaled and at the loss scale dynamic scaling would settle at

Everything is measured in fp32 so the true magnitudes are seen; fp16 is what they are judged
against. Verdicts: inference OK / OVERFLOW, training (with loss scaling) OK / OVERFLOW /
UNDERFLOW-RISK.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from rich.table import Table

from parity import devices, testbed, ui
from parity.audit.inputs import read_prompts
from parity.errors import ParityError
from parity.models.loading import load_policy, max_positions
from parity.models.precision import fp16_kernels, low_precision_copy
from parity.runs.dirs import check_run_dir, free_dir
from parity.tasks import prompt_token_ids
from parity.tasks.data import text_prompts

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24
INIT_SCALE_LOG2 = 16  # LossScaler's (and GradScaler's) default initial scale, 2**16
# Training is flagged when a gradient still loses more than this share of its norm below 2**-24
# at the settled loss scale (‖lost‖ / ‖g‖, _underflows). Counting values instead refuses models
# that train fine: values a million times below a tensor's largest carry nothing of its update.
# 1% is ten times what fp16's rounding of every value already costs a gradient (0.06-0.11% of
# its norm on the testbed's text-xs) and is what an fp16 gradient measurably loses where the
# check says so: docs/fp16-check.md and tests/test_fp16_check.py.
UNDERFLOW_RISK_NORM = 0.01
MAX_TOKENS = 512  # per prompt: the check wants magnitudes, not long contexts
_EXP_OFFSET, _EXP_BINS = 160, 300  # frexp exponents of fp32 values lie in [-148, 128]


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Counts that decide how `t` fares in fp16. A value beyond 65504 is inf in fp16 (strictly,
    values below 65520 round down to 65504, but a tensor that close has no headroom anyway);
    a nonzero value below 2**-14 is subnormal and keeps fewer bits; below 2**-24 it rounds to 0
    or to 2**-24, i.e. nothing of its value survives."""
    a = t.detach().abs().float().flatten()
    finite = torch.isfinite(a)
    fa = a[finite]
    nz = fa[fa != 0]
    return {"numel": a.numel(), "nonfinite": int((~finite).sum()),
            "max_abs": float(fa.max()) if fa.numel() else 0.0,
            "over_max": int((fa > FP16_MAX).sum()), "nonzero": nz.numel(),
            "below_normal": int((nz < FP16_MIN_NORMAL).sum()),
            "below_subnormal": int((nz < FP16_MIN_SUBNORMAL).sum())}


def merge(acc: dict[str, Any] | None, s: dict[str, Any]) -> dict[str, Any]:
    """tensor_stats of two tensors as one (other keys of `acc` are kept)."""
    return dict(s) if acc is None else {**acc, **{k: max(acc[k], v) if k == "max_abs" else
                                                  acc[k] + v for k, v in s.items()}}


def exponent_hist(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per binary exponent of the nonzero finite |t| (|x| = m·2**e, 0.5 <= m < 1, so |x| < 2**k
    exactly when e <= k): how many values, and their sum of squares. Any loss scale can then be
    judged after the fact, without keeping the gradients."""
    a = t.detach().abs().float().flatten()
    a = a[(a != 0) & torch.isfinite(a)]
    e = torch.frexp(a).exponent.long() + _EXP_OFFSET
    return (torch.bincount(e, minlength=_EXP_BINS),
            torch.bincount(e, weights=a.double() ** 2, minlength=_EXP_BINS))


def below_pow2(hist: torch.Tensor, k: int) -> float:
    """The part of an exponent histogram with |x| < 2**k."""
    return float(hist[:max(0, min(_EXP_BINS, k + _EXP_OFFSET + 1))].sum())


class GradAccum:
    """One gradient tensor's (or one module output's gradient's) figures over the prompts."""

    def __init__(self) -> None:
        self.max_abs, self.nonfinite = 0.0, 0
        self.count = torch.zeros(_EXP_BINS, dtype=torch.long, device="cpu")
        self.sq = torch.zeros(_EXP_BINS, dtype=torch.float64, device="cpu")

    def add(self, g: torch.Tensor) -> GradAccum:
        a = g.detach().abs().float()
        finite = torch.isfinite(a)
        self.nonfinite += int((~finite).sum())
        if finite.any():
            self.max_abs = max(self.max_abs, float(a[finite].max()))
        count, sq = exponent_hist(a)
        self.count += count.cpu()
        self.sq += sq.cpu()
        return self

    def summary(self, scale_log2: int) -> dict[str, Any]:
        """Counted fractions say how many values fp16 loses; norm fractions say how much of the
        update they carried (‖lost‖² / ‖g‖²), which is what decides whether losing them hurts:
        values a billion times smaller than their neighbours vanish in any sum anyway."""
        nonzero, sq = int(self.count.sum()), float(self.sq.sum())
        k, ks = -24, -24 - scale_log2
        return {"max_abs": self.max_abs, "nonfinite": self.nonfinite, "nonzero": nonzero,
                "underflow_frac": below_pow2(self.count, k) / max(nonzero, 1),
                "underflow_frac_scaled": below_pow2(self.count, ks) / max(nonzero, 1),
                "underflow_norm_frac": below_pow2(self.sq, k) / sq if sq else 0.0,
                "underflow_norm_frac_scaled": below_pow2(self.sq, ks) / sq if sq else 0.0}


def _tensors(out: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors of a module's output: a tensor, tuple/list, or dict (HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif depth < 3 and isinstance(out, (tuple, list, dict)):
        for o in (out.values() if isinstance(out, dict) else out):
            yield from _tensors(o, depth + 1)


def default_out(model: str) -> Path:
    return free_dir(Path("audits") / f"{Path(model).name}-fp16-check")


def _encode(tok, prompts: list, limit: int) -> list[torch.Tensor]:
    """Token ids as `parity audit` makes them: a conversation goes through the chat template."""
    ids = [torch.tensor([prompt_token_ids(tok, p, False, f"prompt {i}")[:limit]],
                        device="cpu")
           for i, p in enumerate(prompts)]
    ids = [x for x in ids if x.shape[1] > 0]
    if not ids:
        raise ParityError("fp16-check: no prompt has any token after tokenization")
    return ids


def _fp16_forward(net: torch.nn.Module, ids: list[torch.Tensor]) -> dict[str, Any]:
    """The prompts through a real fp16 copy, with tensor-core numerics, against fp32. The fp32
    logits are recomputed rather than kept from _scan: [T, V] per prompt is hundreds of MB for a
    real model's vocabulary, and a no-grad forward is cheap next to _scan's backward."""
    half = low_precision_copy(net, "fp16")
    bad, max_diff, lp_sum, n = 0, 0.0, 0.0, 0
    # On CUDA the copy runs fp16's own kernels; on the CPU their emulation (precision.py).
    device = next(net.parameters()).device
    with torch.no_grad(), fp16_kernels("fp16", device, "emulate"):
        for x in ids:
            ref = net(input_ids=x, use_cache=False).logits.float()
            lo = half(input_ids=x, use_cache=False).logits.float()
            if not torch.isfinite(lo).all():
                bad += 1
                continue
            max_diff = max(max_diff, float((lo - ref).abs().max()))
            nxt = x[:, 1:, None]  # log-prob of each prompt token given its prefix, as β does
            d = (lo.log_softmax(-1)[:, :-1].gather(-1, nxt) -
                 ref.log_softmax(-1)[:, :-1].gather(-1, nxt)).abs()
            lp_sum, n = lp_sum + float(d.sum()), n + d.numel()
    return {"nonfinite_prompts": bad, "max_logit_diff": max_diff if n else None,
            "mean_logprob_diff": lp_sum / n if n else None, "tokens_compared": n}


def _scan(net: torch.nn.Module, ids: list[torch.Tensor], progress: bool):
    """One fp32 forward and backward per prompt, every module's outputs and their gradients
    recorded by hooks. Returns (activation stats, output-gradient accumulators)."""
    names = {m: (n or "(model)") for n, m in net.named_modules()}
    leaf = {names[m]: next(m.children(), None) is None for m in net.modules()}
    acts: dict[str, dict[str, Any]] = {}
    agrads: dict[str, GradAccum] = {}

    def on_grad(name: str, g: torch.Tensor) -> None:  # a tensor hook must return None
        agrads.setdefault(name, GradAccum()).add(g)

    def hook(mod, inp, output):
        name = names[mod]
        for t in _tensors(output):
            if t.is_floating_point():
                acts[name] = {"order": len(acts), "leaf": leaf[name],  # kept from the 1st call
                              **merge(acts.get(name), tensor_stats(t))}
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: on_grad(name, g))

    handles = [m.register_forward_hook(hook) for m in net.modules()]
    n_loss = sum(x.shape[1] >= 2 for x in ids)  # a one-token prompt has nothing to predict
    net.zero_grad(set_to_none=True)
    try:
        with ui.progress("fp16-check", len(ids), progress, transient=True) as bar:
            for x in ids:
                logits = net(input_ids=x, use_cache=False).logits
                if x.shape[1] >= 2:
                    # A batch's mean next-token loss, one prompt at a time so that no padding
                    # enters the statistics.
                    (F.cross_entropy(logits[0, :-1].float(), x[0, 1:]) / n_loss).backward()
                bar.advance()
    finally:
        for h in handles:
            h.remove()
    return acts, agrads, n_loss


def check(model: str, prompts_file: str | None = None, max_prompts: int = 8,
          out: Path | None = None, progress: bool = True, device: str = "auto"
          ) -> dict[str, Any]:
    """Run every check on `device` (a `device` setting: parity/devices.py); returns
    fp16_check.json's content (also written to `out`). Input is checked before anything is
    loaded or written."""
    t0 = time.perf_counter()
    if max_prompts <= 0:
        raise ParityError("fp16-check: --max-prompts must be > 0")
    dev = devices.resolve(device)
    out = out or default_out(model)
    check_run_dir(out)
    prompts = (read_prompts(prompts_file) if prompts_file else
               text_prompts(max_prompts))[:max_prompts]
    model_dir = testbed.resolve_model(model)
    net, tok = load_policy(model_dir)
    net.eval().to(dev)
    ids = [x.to(dev) for x in _encode(tok, prompts, min(MAX_TOKENS, max_positions(net)
                                                        or MAX_TOKENS))]
    fwd = _fp16_forward(net, ids)  # first: its deepcopy would carry hooks and gradients
    acts, agrads, n_loss = _scan(net, ids, progress)
    pgrads = {n: GradAccum().add(p.grad) for n, p in net.named_parameters() if p.grad is not None}
    gmax = max([g.max_abs for g in (*pgrads.values(), *agrads.values())], default=0.0)
    # Dynamic scaling halves the scale on every overflowing step, so it settles at the largest
    # power of two at or below 2**16 that keeps the largest gradient finite.
    settled = INIT_SCALE_LOG2 if gmax == 0 else min(
        INIT_SCALE_LOG2, math.floor(math.log2(FP16_MAX / gmax)))
    result = {
        "model": model, "model_dir": str(model_dir), "device": devices.describe(dev),
        "n_params": sum(p.numel() for p in net.parameters()),
        "prompts": {"source": prompts_file or "testbed.text_prompts", "count": len(ids),
                    "tokens": sum(x.shape[1] for x in ids), "trained": n_loss},
        "fp16": {"max": FP16_MAX, "min_normal": FP16_MIN_NORMAL,
                 "min_subnormal": FP16_MIN_SUBNORMAL},
        "weights": {n: {"shape": list(p.shape), **tensor_stats(p)}
                    for n, p in net.named_parameters()},
        "activations": acts,
        "fp16_forward": fwd,
        "gradients": {
            "loss": "mean next-token cross-entropy over the sample prompts, fp32",
            "max_abs": gmax, "init_scale": 2.0**INIT_SCALE_LOG2,
            "scaled_max_at_init": gmax * 2.0**INIT_SCALE_LOG2,
            "overflows_at_init": gmax * 2.0**INIT_SCALE_LOG2 > FP16_MAX,
            "settled_scale": 2.0**settled,
            "params": {n: g.summary(settled) for n, g in pgrads.items()},
            "activations": {n: g.summary(settled) for n, g in agrads.items()}},
    }
    result.update(judge(result))
    result["seconds"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp16_check.json").write_text(json.dumps(result, indent=1))
    result["out"] = str(out)
    return result


def _origins(over: set[str]) -> list[str]:
    """Overflowing modules none of whose submodules overflow: where the overflow is produced
    (a container inherits its child's output; a decoder layer adds the residual itself)."""
    return [n for n in over if not any(o != n and (n == "(model)" or o.startswith(n + "."))
                                       for o in over)]


def lost_norm(s: dict[str, Any], at: str) -> float:
    """The share of a gradient's norm that fp16 loses below 2**-24, ‖lost‖ / ‖g‖ (`at`:
    "_scaled" at the settled loss scale, "" unscaled)."""
    return math.sqrt(s[f"underflow_norm_frac{at}"])


def _underflows(g: dict[str, Any], at: str) -> dict[str, float]:
    """Gradients, of parameters and of module outputs, whose lost part carries more than
    UNDERFLOW_RISK_NORM of their norm. A value lost far below its tensor's largest ones changes
    the update by as little as it weighs in the norm; Adam's ε (1e-8) also mutes a coordinate
    whose whole gradient is that small, so a lost stray value does not lose its update either."""
    out = {n: lost_norm(s, at) for n, s in g["params"].items()}
    out.update({f"{n} (output grad)": lost_norm(s, at) for n, s in g["activations"].items()})
    return {n: v for n, v in out.items() if v > UNDERFLOW_RISK_NORM}


def judge(r: dict[str, Any]) -> dict[str, Any]:
    """Verdicts, their reasons and suggested fixes, from the figures alone."""
    inf_reasons, train_reasons, fixes = [], [], []
    bad_w = {n: w for n, w in r["weights"].items() if w["over_max"] or w["nonfinite"]}
    if bad_w:
        mods = sorted({n.rsplit(".", 1)[0] for n in bad_w})
        inf_reasons.append(f"{len(bad_w)} weight tensor(s) exceed 65504: "
                           f"{', '.join(sorted(bad_w))}")
        fixes.append(f"weights beyond fp16's range in {', '.join(mods)}: keep these modules in "
                     f"fp32 (or bf16) when casting to fp16, or fold the scale into a neighbour")
    acts = r["activations"]
    over = {n for n, s in acts.items() if s["over_max"] or s["nonfinite"]}
    if over:
        where = sorted(_origins(over), key=lambda n: acts[n]["order"])
        named = ", ".join(n if acts[n]["leaf"] else f"{n} (in its own code, not a submodule: for a "
                          f"decoder layer, the residual stream)" for n in where)
        inf_reasons.append(f"activations exceed 65504 in {len(over)} module output(s), produced "
                           f"at {named}")
        fixes.append(f"activations overflow at {', '.join(where)} (first: {where[0]}): keep "
                     f"these modules in fp32, or run bf16 (fp32's range) for this model")
    nf = r["fp16_forward"]["nonfinite_prompts"]
    if nf:
        inf_reasons.append(f"the fp16 forward gave inf/NaN logits on {nf} of "
                           f"{r['prompts']['count']} prompts")
    if inf_reasons:  # the training forward computes in fp16 too (autocast)
        train_reasons.append("the forward overflows as for inference: autocast computes it in "
                             "fp16 too")
    g = r["gradients"]
    if g["max_abs"] > FP16_MAX:
        train_reasons.append(f"max |gradient| {g['max_abs']:.3g} exceeds 65504 even unscaled")
    lost, lost_unscaled = _underflows(g, "_scaled"), _underflows(g, "")
    if inf_reasons:
        inference, training = "OVERFLOW", "OVERFLOW"
    else:
        inference = "OK"
        training = "OVERFLOW" if train_reasons else ("UNDERFLOW-RISK" if lost else "OK")
    if lost:
        worst = max(lost, key=lost.get)
        train_reasons.append(
            f"{len(lost)} gradient(s) still lose more than {UNDERFLOW_RISK_NORM:.0%} of their norm "
            f"below 2**-24 at loss scale {g['settled_scale']:g}: {', '.join(sorted(lost))} "
            f"(worst {worst}: {lost[worst]:.1%} of its norm)")
        fixes.append("gradients underflow even with loss scaling: keep the modules named above "
                     "in fp32, or train in bf16 / fp32 and use fp16 for the engine only")
    elif lost_unscaled and training != "OVERFLOW":
        worst = max(lost_unscaled, key=lost_unscaled.get)
        fixes.append(f"without loss scaling {worst} would lose {lost_unscaled[worst]:.1%} of its "
                     f"norm below 2**-24: keep dynamic loss scaling on (parity's fp16 recipe does; "
                     f"at {g['settled_scale']:g} it recovers them)")
    if inference == "OK" and training == "OK" and not fixes:
        fixes.append("nothing to fix: fp16 holds every weight, activation and gradient seen")
    return {"verdict": {"inference": inference, "training": training},
            "reasons": {"inference": inf_reasons, "training": train_reasons},
            "suggestions": fixes}


def _headroom(m: float) -> str:
    if m == 0:
        return "inf"
    h = FP16_MAX / m
    if h < 1:
        return f"[red]over by {1 / h:.3g}x[/]"
    return f"{h:,.0f}x" if h >= 100 else f"{h:.3g}x"


def _share(x: float) -> str:
    return f"{x:.1%}" if x >= 1e-3 or x == 0 else f"{x:.2g}"


def _pct(n: float, d: float) -> str:
    return f"{n / d:.2%}" if d else "-"


def _table(title: str, cols: tuple[str, ...], rows: list[tuple], caption: str):
    t = Table(title=title, caption=caption)
    for i, col in enumerate(cols):
        t.add_column(col, justify="right" if i else "left")
    for row in rows:
        t.add_row(*row)
    return t


def _range_rows(stats: dict[str, dict[str, Any]], top: int) -> list[tuple]:
    return [(n, f"{s['max_abs']:.3g}", _headroom(s["max_abs"]), str(s["over_max"] + s["nonfinite"]),
             _pct(s["below_normal"], s["nonzero"]), _pct(s["below_subnormal"], s["nonzero"]))
            for n, s in sorted(stats.items(), key=lambda kv: -kv[1]["max_abs"])[:top]]


def print_check(r: dict[str, Any], top: int = 10) -> None:
    console = ui.console()
    p, g, f = r["prompts"], r["gradients"], r["fp16_forward"]
    tail = ("> 65504", "< 2^-14 (subnormal)", "< 2^-24 (lost)")
    cap = "fractions of nonzero values; headroom = 65504 / max"
    console.print(_table(f"weights: top {top} tensors by max |w|",
                         ("weight", "max |w|", "headroom", *tail),
                         _range_rows(r["weights"], top), cap + " |w|"))
    console.print(_table(f"activations: top {top} module outputs by max |x| (fp32 forward, "
                         f"{p['count']} prompts, {p['tokens']} tokens)",
                         ("module", "max |x|", "headroom", *tail),
                         _range_rows(r["activations"], top), cap + " |x|"))
    sc = f"{g['settled_scale']:g}"
    worst = sorted(g["params"].items(), key=lambda kv: (-kv[1]["underflow_norm_frac_scaled"],
                                                        -kv[1]["underflow_frac_scaled"]))[:top]
    console.print(_table(f"gradients: top {top} parameter tensors by norm lost below 2^-24 at "
                         f"scale {sc}",
                         ("parameter", "max |g|", "norm lost", "values lost", "norm lost unscaled"),
                         [(n, f"{s['max_abs']:.3g}", f"{lost_norm(s, '_scaled'):.3%}",
                           f"{s['underflow_frac_scaled']:.2%}", f"{lost_norm(s, ''):.3%}")
                          for n, s in worst],
                         f"norm lost = ||lost|| / ||g|| (the verdict: above "
                         f"{UNDERFLOW_RISK_NORM:.0%} is a risk); values lost = nonzero values "
                         f"fp16 rounds to 0 or 2^-24"))
    w = max(r["weights"].items(), key=lambda kv: kv[1]["max_abs"])
    a = max(r["activations"].items(), key=lambda kv: kv[1]["max_abs"])
    wsum = {k: sum(s[k] for s in r["weights"].values()) for k in
            ("nonzero", "below_normal", "below_subnormal")}
    lines = [f"max weight {w[1]['max_abs']:.3g} ({w[0]}), headroom {_headroom(w[1]['max_abs'])}; "
             f"{_pct(wsum['below_normal'], wsum['nonzero'])} of nonzero weights are fp16 "
             f"subnormals, {_pct(wsum['below_subnormal'], wsum['nonzero'])} lost",
             f"max activation {a[1]['max_abs']:.3g} ({a[0]}), "
             f"headroom {_headroom(a[1]['max_abs'])}"]
    if f["nonfinite_prompts"]:
        lines.append(f"fp16 forward: [red]inf/NaN logits on {f['nonfinite_prompts']} of "
                     f"{p['count']} prompts[/]")
    else:
        lines.append(f"fp16 forward: logits finite; max |logit diff| vs fp32 "
                     f"{f['max_logit_diff']:.3g}, mean |log-prob diff| "
                     f"{f['mean_logprob_diff']:.3g} over {f['tokens_compared']} tokens")
    back = f"overflows: the scaler backs off to {sc}" if g["overflows_at_init"] else "fits"
    lines.append(f"gradients (LM loss, {p['trained']} prompts): max |g| {g['max_abs']:.3g}; "
                 f"x 2^16 = {g['scaled_max_at_init']:.3g} {back}")
    if g["activations"]:
        n, s = max(g["activations"].items(), key=lambda kv: kv[1]["underflow_norm_frac"])
        lines.append(f"module output gradients: the worst ({n}) loses "
                     f"{_share(lost_norm(s, ''))} of its norm unscaled ({s['underflow_frac']:.1%} "
                     f"of its values), {_share(lost_norm(s, '_scaled'))} at scale {sc}")
    colour = {"OK": "green", "OVERFLOW": "red", "UNDERFLOW-RISK": "yellow"}
    for kind, label in (("inference", "inference in fp16"),
                        ("training", "training in fp16 with loss scaling")):
        v = r["verdict"][kind]
        lines.append(f"[bold]{label}: [{colour[v]}]{v}[/][/]")
        lines += [f"  - {reason}" for reason in r["reasons"][kind]]
    lines += [f"suggestion: {x}" for x in r["suggestions"]]
    for line in lines:
        console.print(line)
