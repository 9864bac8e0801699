"""Phantom-clipping diagnostics: every log-ratio split into policy change and precision gap.

    log r = ℓ_π − ℓ_μ = α + β,   α = ℓ_s − ℓ_μ   policy change, both sides in engine precision
                                 β = ℓ_π − ℓ_s   precision gap on the same weights

ℓ_s comes from the shadow forward: the trainer's current weights cast to engine precision, one
no-grad forward per update. Every clip is then attributed (docs/design.md):

    clipped  C(α + β, A)      phantom  C(α + β, A) ∧ ¬C(α, A)      hidden  ¬C(α + β, A) ∧ C(α, A)

The same functions serve the trainer (every update) and `parity audit` (offline, one update at
θ = θ_old); `StepDiagnostics` turns a step's tokens into the metrics docs/design.md names.
"""

from __future__ import annotations

# Imports inside functions: pyarrow loads when a rollout dump is written (start-up time).
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parity import metric_names as mn
from parity.engines import Engine
from parity.logprobs import Rollout, Sampling, log_softmax, processed_logits, row_chunk
from parity.models.forward import score
from parity.models.invariant import engine_attention_of
from parity.models.precision import cast_weights_into, fp16_kernels, low_precision_copy
from parity.objectives import LOG_RATIO_CAP, clip_predicate, clipped_tokens, log_ratio

# Buckets for β by the trainer's token probability and by position in the completion: where
# the gap lives (rare tokens? late positions?) decides which fix helps.
PROB_BUCKETS = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
POS_BUCKETS = (0, 8, 32, 128, 512, math.inf)
EPS_SWEEP = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


class Shadow:
    """The shadow forward: ℓ_s = log π_θ(y) in engine precision on the trainer's current weights.

    It keeps its own engine-dtype copy of the model (the engine's copy must keep the weights it
    sampled with, for `sync/changed_frac`). An fp32 engine against an fp32 trainer runs the very
    same forward as the trainer, so there ℓ_s = ℓ_π and no extra forward is run."""

    def __init__(self, master: torch.nn.Module, engine_dtype: str, trainer_dtype: str,
                 cpu_fp16: str = "emulate", lm_head_fp32: bool = False, chunk: int = 0,
                 kernels: str = "engine", engine: Engine | None = None):
        self.identity = engine_dtype == "fp32" and trainer_dtype == "fp32" and kernels != "scored"
        self.dtype, self.cpu_fp16, self.chunk = engine_dtype, cpu_fp16, chunk
        self.model = None
        # `scored`: the engine computes ℓ_s itself (Engine.score), so its kernels are the
        # sampler's own.
        self.engine = engine if kernels == "scored" else None
        if not self.identity and self.engine is None:
            self.model = low_precision_copy(master, engine_dtype, lm_head_fp32)
            if kernels == "engine":  # else the copy keeps the trainer's own attention
                self.model.set_attn_implementation(engine_attention_of(self.model))

    @torch.no_grad()
    def logprobs(self, master: torch.nn.Module, r: Rollout, s: Sampling,
                 logp_pi: torch.Tensor | None = None, cast: bool = True) -> torch.Tensor:
        """ℓ_s of `r` on `master`'s weights; `cast=False` when they were cast for an earlier
        piece of the same update and have not moved since."""
        if self.identity:
            if logp_pi is None:
                return score(master, r, s, chunk=self.chunk)
            return logp_pi.detach()
        if self.engine is not None:
            return self.engine.score(master, r, s)
        if cast:
            cast_weights_into(master, self.model, count=False)
        device = next(self.model.parameters()).device
        with fp16_kernels(self.dtype, device, self.cpu_fp16):
            return score(self.model, r, s, chunk=self.chunk)


@dataclass(kw_only=True)
class Attribution:
    """Per-token decomposition and clip attribution of one update, [B, T]; 0/False on padding."""
    alpha: torch.Tensor
    beta: torch.Tensor
    clipped: torch.Tensor
    phantom: torch.Tensor
    hidden: torch.Tensor
    alpha_clipped: torch.Tensor


def attribute(logp_pi: torch.Tensor, logp_s: torch.Tensor, logp_mu: torch.Tensor,
              adv: torch.Tensor, mask: torch.Tensor, eps_low: float | None,
              eps_high: float | None, clipped: torch.Tensor | None = None,
              sequence: bool = False) -> Attribution:
    """α, β and the clip attribution. `clipped` is what the objective really clipped when its
    ratio is not ℓ_π − ℓ_μ (the shadow ratio clips on α alone); by default C(α + β, A).
    `sequence`: the objective clips a sequence's mean log-ratio (GSPO), so C applies to the
    token means of α and α + β, and a sequence's verdict holds for all its tokens."""
    valid = mask > 0    # not a product with the mask: padding may hold anything, and inf·0 is NaN
    alpha = torch.where(valid, (logp_s - logp_mu).detach(), 0.0)
    beta = torch.where(valid, (logp_pi - logp_s).detach(), 0.0)
    c_alpha = clipped_tokens(alpha, adv, mask, eps_low, eps_high, sequence)
    if clipped is None:
        clipped = clipped_tokens(alpha + beta, adv, mask, eps_low, eps_high, sequence)
    c = clipped & (mask > 0)
    return Attribution(alpha=alpha, beta=beta, clipped=c, phantom=c & ~c_alpha,
                       hidden=~c & c_alpha, alpha_clipped=c_alpha)


def measure(diag: "StepDiagnostics", logp_pi: torch.Tensor, logp_s: torch.Tensor,
            logp_mu: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
            eps_low: float | None, eps_high: float | None, *, ratio_source: str = "engine",
            logp_old: torch.Tensor | None = None, clipped: torch.Tensor | None = None,
            sequence: bool = False, first: bool = True) -> Attribution:
    """The one measurement of a batch, shared by the trainer, the audit and the TRL trainers:
    α, β and the clip attribution, added to the step's diagnostics `diag`.

    `clipped` is what the objective really clipped, when the caller has it (the trainer's
    loss). Otherwise it is C(log r, A) on the log-ratio of `ratio_source`, as objectives'
    `log_ratio` defines it (`logp_old`: ℓ_old, for `recompute`). `first`: the weights still
    equal those the engine sampled with, so the KLs and the kernel gap are the mismatch alone.
    Sequence-level clipping (GSPO) judges each sequence on its mean advantage."""
    a = adv.mean(-1) if sequence and adv.dim() == 2 else adv
    if clipped is None:
        log_r = log_ratio(ratio_source, logp_pi.detach(), logp_mu, logp_s, logp_old)
        clipped = clipped_tokens(log_r, a, mask, eps_low, eps_high, sequence)
    att = attribute(logp_pi, logp_s, logp_mu, a, mask, eps_low, eps_high, clipped,
                    sequence=sequence)
    diag.add(att, logp_pi, logp_mu, adv, mask, first=first)
    return att


def kl_estimates(logp_pi: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor
                 ) -> dict[str, float]:
    """The sampled estimates (docs/design.md) over valid tokens, Δ = ℓ_π − ℓ_μ: k1 = mean(−Δ),
    k3 = mean(exp(Δ) − Δ − 1) with Δ taken at min(Δ, LOG_RATIO_CAP) (exp(Δ) overflows float64
    past Δ = 709, and a mean of large terms sooner), and the probability differences
    exp(ℓ_π) − exp(ℓ_μ). k1 and the differences are exact for any finite log-probs."""
    m = mask > 0
    d = (logp_pi - logp_mu)[m].double()
    if d.numel() == 0:
        return {}
    pdiff = (logp_pi.double().exp() - logp_mu.double().exp())[m]
    dc = d.clamp(max=LOG_RATIO_CAP)
    return {mn.KL_K1: float((-d).mean()),
            mn.KL_K3: float((dc.exp() - dc - 1).mean()),
            mn.PROB_DIFF_ABS_MEAN: float(pdiff.abs().mean()),
            mn.PROB_DIFF_MAX: float(pdiff.max()),
            mn.PROB_DIFF_MIN: float(pdiff.min())}


def exact_kl(mu_logp: torch.Tensor, pi_logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """KL(μ‖π) = Σ_v μ_v (log μ_v − log π_v) over the whole vocabulary at each of N positions.
    `mu_logp` [N, V] is the engine's sampling distribution (−inf outside its top-k/top-p
    support); π is the trainer's, processed the same way, except that a token μ can sample is
    never excluded from π (as when scoring), so the KL stays finite. Each position's sum is
    its own, so computing `row_chunk` positions at a time changes nothing but the memory and
    its cost (parity/logprobs/scoring.py). Returns float64 [N]."""
    c = row_chunk(mu_logp.shape[-1], mu_logp.device)
    return torch.cat([_exact_kl(mu_logp[a:a + c], pi_logits[a:a + c], s)
                      for a in range(0, mu_logp.shape[0], c)]
                     or [mu_logp.new_zeros(0, dtype=torch.float64)])


# Below this log-prob a token counts as outside μ's support in the exact KL: μ = e^{-80} is still
# a normal float32, so μ·e^{−d} never loses the π it stands for; what is left out, Σ μ(1 − d),
# is below 1e-28.
LOG_MU_FLOOR = -80.0


def _exact_kl(mu_logp: torch.Tensor, pi_logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    # With d = log μ − log π, over μ's support S:
    #   KL = Σ_S μ (e^{−d} − 1 + d) + Σ_{v∉S} π_v
    # (Σ_S μ e^{−d} = Σ_S π = 1 − Σ_{∉S} π). Every term is ≥ 0, so nothing cancels, and a
    # log-normaliser off by c (fp32's log-sum-exp over 151,936 logits is, by about 1e-6) moves
    # the sum by c·(Σ_{∉S} π − Σ_{∉S} π) = 0 to first order, where Σ μ d moves by c itself.
    # So float32 suffices: tests/test_diagnostics.py holds KLs down to 5e-7 within 5e-4 of a
    # float64 sum, and bench/vocab_step.py --parts times the sum at Qwen3's vocabulary.
    x = processed_logits(pi_logits, s)
    if s.truncates:
        support = torch.isfinite(mu_logp)
        x = torch.where(support & ~torch.isfinite(x), pi_logits.float() / s.temperature, x)
    nd = log_softmax(x)                      # the engine's own log-softmax
    some_out = s.truncates or bool(mu_logp.min() < LOG_MU_FLOOR)
    if some_out:
        keep = mu_logp > LOG_MU_FLOOR
        outside = nd.exp().masked_fill_(keep, 0.0).sum(-1)
    nd.sub_(mu_logp)                         # −d = log π − log μ
    term = torch.expm1(nd).sub_(nd)          # e^{−d} − 1 + d
    if some_out:
        term.masked_fill_(~keep, 0.0)        # inf − inf there, where μ = 0
    kl = torch.linalg.vecdot(mu_logp.exp(), term)
    return (kl + outside if some_out else kl).double()


def exact_kl_rows(batch: int, k: int) -> list[int]:
    """k rows spread over the batch (so over k different prompt groups where k <= prompts):
    the completions whose whole engine distribution is kept for the exact KL."""
    k = min(k, batch)
    return [i * batch // k for i in range(k)] if k else []


def kept_rows(r: Rollout, sl: slice) -> list[int]:
    """The rows of `r` in `sl` whose sampling distribution the engine kept, in `r`'s numbering."""
    if r.dist_rows is None:
        return []
    return [row for row in r.dist_rows.tolist() if sl.start <= row < sl.stop]


def exact_kl_of_rows(r: Rollout, logits: torch.Tensor, rows: list[int], mask: torch.Tensor,
                     s: Sampling) -> torch.Tensor:
    """Exact KL(μ‖π) at the valid positions of `rows` of `r` (each one whose distribution the
    engine kept) that the engine recorded, from the trainer's logits of those rows at those
    positions, [k, n, V], with `mask` [k, T]: no extra forward."""
    where = {row: j for j, row in enumerate(r.dist_rows.tolist())}
    kls = []
    for i, row in enumerate(rows):
        n = min(int(mask[i].sum()), r.dists.shape[1], logits.shape[1])
        kls.append(exact_kl(r.dists[where[row], :n], logits[i, :n], s))
    return torch.cat(kls) if kls else torch.empty(0, device=mask.device)


def clip_fractions(alpha: torch.Tensor, beta: torch.Tensor, adv: torch.Tensor | None,
                   eps_low: float | None, eps_high: float | None) -> dict[str, float]:
    """clip / phantom / hidden / α-clipped fractions of flat valid tokens at one clip range.
    With no advantages (an audit of bare completions) each token counts half as A > 0 and half
    as A < 0: the expectation under an advantage of random sign."""
    signs = [adv] if adv is not None else [torch.ones_like(alpha), -torch.ones_like(alpha)]
    out = {"clip": 0.0, "phantom": 0.0, "hidden": 0.0, "alpha": 0.0}
    for a in signs:
        c = clip_predicate(alpha + beta, a, eps_low, eps_high)
        ca = clip_predicate(alpha, a, eps_low, eps_high)
        for k, v in (("clip", c), ("phantom", c & ~ca), ("hidden", ~c & ca), ("alpha", ca)):
            out[k] += float(v.double().mean()) / len(signs) if v.numel() else 0.0
    return out


def _cluster_se(x: torch.Tensor, u: torch.Tensor, cluster: torch.Tensor) -> float:
    """The cluster-robust (CR0 sandwich) standard error of the least-squares slope of y on x,
    from regressor x and residuals u: sqrt(Σ_c (Σ_{t∈c} x_t u_t)²) / Σ_t x_t². A completion's
    tokens share its advantage and its prompt, so they are not independent draws; summing
    within a completion before squaring lets them count as one. With x = 1 it is the standard
    error of a mean."""
    score = torch.zeros(int(cluster.max()) + 1, dtype=torch.float64, device=x.device).index_add_(
        0, cluster, (x * u).double())
    return float(score.square().sum().sqrt()) / float(x.double().square().sum())


def mean_and_cluster_se(y: torch.Tensor, cluster: torch.Tensor) -> tuple[float, float]:
    """y's mean and its standard error with each cluster (completion) as one draw."""
    y = y.double()
    return float(y.mean()), _cluster_se(torch.ones_like(y), y - y.mean(), cluster)


def corr_and_cluster_se(y: torch.Tensor, x: torch.Tensor, cluster: torch.Tensor
                        ) -> tuple[float, float] | None:
    """corr(y, x) as the slope of standardised y on standardised x, and that slope's
    cluster-robust standard error; None when either does not vary."""
    y, x = y.double() - y.double().mean(), x.double() - x.double().mean()
    if float(y.norm()) == 0 or float(x.norm()) == 0:
        return None
    zy, zx = y / y.square().mean().sqrt(), x / x.square().mean().sqrt()
    r = float((zx * zy).sum() / zx.square().sum())
    return r, _cluster_se(zx, zy - r * zx, cluster)


def _slope(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Least-squares slope of y against x; None when x does not vary."""
    x, y = x.double(), y.double()
    var = float(((x - x.mean()) ** 2).sum())
    return float(((x - x.mean()) * (y - y.mean())).sum()) / var if var > 0 else None


def _bucket_name(lo: float, hi: float) -> str:
    return f"{lo:g}-{hi:g}" if math.isfinite(hi) else f"{lo:g}+"


class StepDiagnostics:
    """Collects the tokens of one step's updates and returns its metrics.

    Clip fractions, α and β pool every update of the step (so tokens seen in several epochs count
    once per update); the KL estimates, the sequence log-ratio and the exact KL use the step's
    first update only (the first minibatch of epoch 0), where the trainer's weights still equal
    those the engine sampled with and ℓ_π − ℓ_μ is the mismatch alone. The kernel
    gap is |α| on the step's first update, at θ = θ_old: what the engine's and the shadow's
    kernels disagree on with equal weights and precision."""

    def __init__(self) -> None:
        self.tok: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "alpha", "beta", "adv", "prob", "pos", "clipped", "phantom", "hidden",
            "alpha_clipped", "seq")}
        self.n_seq = 0                      # completions seen: each add's rows get new ids
        self.first: dict[str, list[torch.Tensor]] = {"logp_pi": [], "logp_mu": [], "mask": []}
        self.kl_exact: list[torch.Tensor] = []
        self.gap_sum, self.gap_n = 0.0, 0   # |α| over the step's first update
        self.first_update_seen = False

    @classmethod
    def merge(cls, parts: list["StepDiagnostics"]) -> "StepDiagnostics":
        """One step's diagnostics from the ranks' parts (each rank saw its shard of every
        update): the metrics of all their tokens, as one process computes them."""
        out = cls()
        for d in parts:
            for k, v in d.tok.items():
                out.tok[k] += v if k != "seq" else [x + out.n_seq for x in v]
            out.n_seq += d.n_seq
            for k, v in d.first.items():
                out.first[k] += v
            out.kl_exact += d.kl_exact
            out.gap_sum += d.gap_sum
            out.gap_n += d.gap_n
        return out

    def add(self, att: Attribution, logp_pi: torch.Tensor, logp_mu: torch.Tensor,
            adv: torch.Tensor, mask: torch.Tensor, first: bool) -> None:
        m = mask > 0
        pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        a = (adv[:, None] if adv.dim() == 1 else adv).expand_as(mask)
        rows = self.n_seq + torch.arange(mask.shape[0], device=mask.device)
        seq = rows[:, None].expand_as(mask)
        self.n_seq += mask.shape[0]
        for k, v in (("alpha", att.alpha), ("beta", att.beta), ("adv", a),
                     ("prob", logp_pi.detach().exp()), ("pos", pos), ("clipped", att.clipped),
                     ("phantom", att.phantom), ("hidden", att.hidden),
                     ("alpha_clipped", att.alpha_clipped), ("seq", seq)):
            self.tok[k].append(v[m].detach().cpu())
        if not self.first_update_seen:
            self.first_update_seen = True
            self.gap_sum = float(att.alpha[m].abs().double().sum())
            self.gap_n = int(m.sum())
        if first:
            for k, v in (("logp_pi", logp_pi), ("logp_mu", logp_mu), ("mask", mask)):
                self.first[k].append(v.detach().cpu())

    def add_exact_kl(self, kl: torch.Tensor) -> None:
        self.kl_exact.append(kl.detach().cpu())

    def metrics(self) -> dict[str, float]:
        t = {k: torch.cat(v) if v else torch.empty(0, device="cpu")
             for k, v in self.tok.items()}
        out: dict[str, float] = {}
        n = t["beta"].numel()
        if n:
            for name, key in ((mn.CLIP_FRAC, "clipped"), (mn.PHANTOM_FRAC, "phantom"),
                              (mn.HIDDEN_FRAC, "hidden"), (mn.ALPHA_CLIP_FRAC, "alpha_clipped")):
                out[name] = float(t[key].double().mean())
            alpha, beta = t["alpha"].double(), t["beta"].double()
            out[mn.ALPHA_MEAN] = float(alpha.mean())
            out[mn.ALPHA_ABS_MEAN] = float(alpha.abs().mean())
            out[mn.BETA_MEAN], out[mn.BETA_MEAN_SE] = mean_and_cluster_se(
                beta, t["seq"])
            out[mn.BETA_ABS_MEAN] = float(beta.abs().mean())
            out[mn.BETA_STD] = float(beta.std()) if n > 1 else 0.0
            out[mn.BETA_ABS_MAX] = float(beta.abs().max())
            corr = corr_and_cluster_se(beta, t["adv"], t["seq"])
            if corr is not None:
                out[mn.BETA_ADV_CORR], out[mn.BETA_ADV_CORR_SE] = corr
            if self.gap_n:
                out[mn.KERNEL_GAP_ABS_MEAN] = self.gap_sum / self.gap_n
            out.update(_bucketed(beta, t["prob"], PROB_BUCKETS, mn.BETA_BY_PROB))
            out.update(_bucketed(beta, t["pos"], POS_BUCKETS, mn.BETA_BY_POS))
        if self.first["mask"]:
            lp, lm, mk = (_cat_padded(self.first[k]) for k in ("logp_pi", "logp_mu", "mask"))
            out.update(kl_estimates(lp, lm, mk))
            seq = torch.where(mk > 0, lp - lm, 0.0).sum(-1)
            length = mk.sum(-1)
            out[mn.SEQ_LOG_RATIO_MEAN] = float(seq.double().mean())
            slope = _slope(length, seq)
            if slope is not None:
                out[mn.SEQ_LOG_RATIO_SLOPE] = slope
        if self.kl_exact:
            kl = torch.cat(self.kl_exact)
            out[mn.KL_EXACT] = float(kl.mean())
            out[mn.KL_EXACT_POSITIONS] = float(kl.numel())
        return out

    def tokens(self) -> dict[str, torch.Tensor]:
        """Flat per-token tensors over every update (for plots)."""
        return {k: torch.cat(v) if v else torch.empty(0, device="cpu")
             for k, v in self.tok.items()}


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [B_i, T_i] batches along B, right-padding T with zeros."""
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])


def _bucketed(beta: torch.Tensor, key: torch.Tensor, edges: tuple, pattern: str
              ) -> dict[str, float]:
    out = {}
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        sel = (key >= lo) & ((key <= hi) if last else (key < hi))
        if sel.any():
            b = beta[sel].double()
            label = _bucket_name(lo, hi)
            out[pattern.format(bucket=label, stat="mean")] = float(b.mean())
            out[pattern.format(bucket=label, stat="abs_mean")] = float(b.abs().mean())
            out[pattern.format(bucket=label, stat="tokens")] = float(sel.sum())
    return out


# ---- rollout dumps -----------------------------------------------------------------------

DUMP_COLUMNS = ("step", "update", "epoch", "sample_id", "prompt_id", "position", "token_id",
                "advantage", "engine_logprob", "trainer_logprob", "shadow_logprob", "eps_low",
                "eps_high", "clipped", "phantom_clipped", "hidden", "alpha_clipped")


def dump_table(step: int, update: int, epoch: int, sample_ids: torch.Tensor,
               prompt_ids: torch.Tensor, mb: Rollout, adv: torch.Tensor, logp_pi: torch.Tensor,
               logp_s: torch.Tensor, att: Attribution, eps_low: float | None,
               eps_high: float | None) -> Any:
    """The rollout-dump rows (docs/design.md) for one update: one row per valid completion token."""
    import pyarrow as pa
    m = mb.completion_mask > 0
    n = int(m.sum())
    rows, pos = m.nonzero(as_tuple=True)

    def col(x: torch.Tensor) -> Any:
        return x[m].detach().cpu().numpy()

    def const(v, typ) -> Any:
        return pa.array([v] * n, type=typ)

    return pa.table({
        "step": const(step, pa.int32()), "update": const(update, pa.int32()),
        "epoch": const(epoch, pa.int32()),
        "sample_id": sample_ids[rows].cpu().numpy(), "prompt_id": prompt_ids[rows].cpu().numpy(),
        "position": pos.cpu().numpy().astype("int32"), "token_id": col(mb.completion_ids),
        "advantage": (adv[rows] if adv.dim() == 1 else adv[m]).detach().cpu().numpy(),
        "engine_logprob": col(mb.engine_logprobs), "trainer_logprob": col(logp_pi),
        "shadow_logprob": col(logp_s),
        "eps_low": const(eps_low, pa.float64()), "eps_high": const(eps_high, pa.float64()),
        "clipped": col(att.clipped), "phantom_clipped": col(att.phantom),
        "hidden": col(att.hidden), "alpha_clipped": col(att.alpha_clipped),
    })


def write_dump(path: Path, tables: list) -> None:
    """One parquet file, written beside and renamed: a crash never leaves half a dump."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    pq.write_table(pa.concat_tables(tables), tmp)
    os.replace(tmp, path)
