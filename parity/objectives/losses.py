"""Policy objectives, each next to its equation, in docs/design.md's notation.

Shapes: [B, T] per completion token, with `mask` 1 on valid tokens; [B] per completion.
ℓ_π = trainer log-prob (with grad), ℓ_μ = engine log-prob, ℓ_s = shadow log-prob (engine
precision, no grad), ℓ_old = trainer log-prob recomputed before the first update, A = advantage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from parity import metric_names as mn

# ---- advantages ---------------------------------------------------------------------------


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                    eps: float = 1e-4) -> torch.Tensor:
    """A_i = (R_i − mean_g R) / (std_g R + eps) over each group g of `group_size` completions of
    one prompt (consecutive in `rewards`); with scale=False only the centring (Dr.GRPO).
    std is the unbiased sample std, as TRL computes it."""
    r = rewards.view(-1, group_size).double()
    a = r - r.mean(-1, keepdim=True)
    if scale:
        a = a / (r.std(-1, keepdim=True) + eps)
    return a.view(-1).float()


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over completion tokens, the sequence reward paid at its
    last valid token:  δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γλ A_{t+1},  V after the end = 0.
    Returns (advantages, returns = A + V), both [B, T], 0 on padding."""
    B, T = mask.shape
    f64 = dict(dtype=torch.float64, device=mask.device)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    r = torch.zeros(B, T, **f64)
    r[torch.arange(B, device=mask.device), last] = rewards.double()
    v = values.double() * mask
    adv = torch.zeros(B, T, **f64)
    running = torch.zeros(B, **f64)
    for t in reversed(range(T)):
        v_next = v[:, t + 1] if t + 1 < T else torch.zeros(B, **f64)
        delta = r[:, t] + gamma * v_next - v[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv.float(), (adv + v).float() * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
           total: Callable[[float], float] = float) -> torch.Tensor:
    """(x − mean) / std over valid tokens (PPO's advantage normalisation), the unbiased std from
    the sums n, Σx, Σx² in float64. `total` sums each over ranks, so every rank normalises by the
    whole batch's statistics."""
    v = x[mask > 0].double()
    n, s1, s2 = total(float(v.numel())), total(float(v.sum())), total(float((v * v).sum()))
    mean = s1 / n if n else 0.0
    std = math.sqrt(max(s2 - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 1.0
    return (x - mean) / (std + eps) * mask


# ---- the ratio -----------------------------------------------------------------------------

# Where parity exponentiates a log-ratio for a figure or a weight (k3, the behaviour and pg-is
# weights), it takes exp(min(x, 80)): e^80 ≈ 5.5e34 is finite in float32 and below float64's
# largest value by 10^273, so no mean of such terms overflows either. A token or completion
# past it weighs as one at 80 nats (docs/diagnostics.md); a ratio there is already past every
# cap and clip range.
LOG_RATIO_CAP = 80.0


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(min(x, LOG_RATIO_CAP)): a ratio or weight from a log-ratio, finite for any finite x
    and exactly exp(x) below the cap."""
    return log_ratio.clamp(max=LOG_RATIO_CAP).exp()


def log_ratio(source: str, logp_pi: torch.Tensor, logp_mu: torch.Tensor,
              logp_s: torch.Tensor | None = None, logp_old: torch.Tensor | None = None
              ) -> torch.Tensor:
    """log r per the ratio source (docs/design.md):
        engine     ℓ_π − ℓ_μ                         β inside the clip
        shadow     ℓ_π − sg(ℓ_π) + ℓ_s − ℓ_μ          value α = ℓ_s − ℓ_μ, gradient ∇ℓ_π
        recompute  ℓ_π − ℓ_old                       decoupled PPO"""
    if source == "engine":
        return logp_pi - logp_mu
    if source == "shadow":
        return logp_pi - logp_pi.detach() + (logp_s - logp_mu).detach()
    if source == "recompute":
        return logp_pi - logp_old.detach()
    raise ValueError(source)


def behaviour_weights(logp_old: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor,
                      correction: str, cap: float, geo_cap: float, cap_low: float = 0.0
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights w for the engine-vs-trainer mismatch of decoupled PPO, [B, T]:
        token-tis     w_t = min(ρ_t, C)             ρ_t = exp(ℓ_old − ℓ_μ)
        token-mis     w_t = ρ_t · 1[ρ_t ≤ C]
        token-icepop  w_t = ρ_t · 1[C_low ≤ ρ_t ≤ C]   (IcePop: both tails masked)
        seq-tis    w_i = min(ρ_i, C)             ρ_i = exp(Σ_t (ℓ_old − ℓ_μ))
        seq-mis    w_i = ρ_i · 1[ρ_i ≤ C]
        geo-rs     w_i = 1[exp(|mean_t (ℓ_old − ℓ_μ)|) ≤ C_geo]   (reject, do not reweight)
    Each exp is taken at min(·, LOG_RATIO_CAP), so a weight and its statistics stay finite. Also
    the statistics before and after, and the share of weights the cap changed: a log of the
    weights after truncation or masking alone would hide how many were cut."""
    d = _masked(logp_old - logp_mu, mask).double()
    valid = mask > 0
    if correction == "none":
        return mask.to(logp_old.dtype), {}
    if correction.startswith("token"):
        raw = bounded_exp(d)
        if correction == "token-tis":
            w = raw.clamp(max=cap)
        elif correction == "token-icepop":
            w = raw * ((raw >= cap_low) & (raw <= cap))
        else:
            w = raw * (raw <= cap)
        sel = valid
        raw_sel, w_sel = raw[sel], w[sel]
    else:
        if correction == "geo-rs":
            geo = bounded_exp((d.sum(-1) / mask.sum(-1).clamp(min=1)).abs())
            raw, keep = geo, (geo <= geo_cap).double()
            w_seq = keep
        else:
            raw = bounded_exp(d.sum(-1))
            w_seq = raw.clamp(max=cap) if correction == "seq-tis" else raw * (raw <= cap)
        w = w_seq[:, None].expand_as(d) * mask
        raw_sel, w_sel = raw, w_seq
    changed = (w_sel != raw_sel) if correction != "geo-rs" else (w_sel == 0)
    stats = {mn.IS_WEIGHT_MEAN_RAW: float(raw_sel.mean()),
             mn.IS_WEIGHT_MAX_RAW: float(raw_sel.max()),
             mn.IS_WEIGHT_MIN_RAW: float(raw_sel.min()), mn.IS_WEIGHT_MEAN: float(w_sel.mean()),
             mn.IS_FRAC_CHANGED: float(changed.double().mean())}
    return w.float() * mask, stats


# ---- clipping ------------------------------------------------------------------------------


def clip_predicate(log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float | None,
                   eps_high: float | None) -> torch.Tensor:
    """C(x, A) = (A > 0 and x > log(1 + ε_high)) or (A < 0 and x < log(1 − ε_low)): the tokens
    where PPO's min(r·A, clip(r)·A) takes the clipped branch and the gradient is 0."""
    hi = math.log1p(eps_high) if eps_high is not None else math.inf
    lo = math.log1p(-eps_low) if eps_low is not None else -math.inf
    return ((adv > 0) & (log_ratio > hi)) | ((adv < 0) & (log_ratio < lo))


def ppo_clip_token_loss(log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float | None,
                        eps_high: float | None) -> torch.Tensor:
    """Per-token PPO-clip loss  −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A),  r = exp(log r),
    with log r taken at min(log r, LOG_RATIO_CAP): past it r·A would be inf, or NaN at A = 0,
    and one such token would void the update. There the token's gradient is 0, as the clip
    already makes it for A > 0. `adv` broadcasts over tokens ([B, 1] for sequence-level GRPO
    advantages)."""
    r = bounded_exp(log_ratio)
    lo = 1 - eps_low if eps_low is not None else 0.0
    hi = 1 + eps_high if eps_high is not None else math.inf
    return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1/|y_i|) Σ_t x_it per sequence, [B]: GSPO's log of the geometric-mean ratio."""
    return _masked(x, mask).sum(-1) / mask.sum(-1).clamp(min=1)


def clipped_tokens(log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   eps_low: float | None, eps_high: float | None, sequence: bool = False
                   ) -> torch.Tensor:
    """Where the clipped branch is taken, [B, T] bool, False on padding. Token level: C(log r_t,
    A). Sequence level (GSPO): C on the sequence's mean log-ratio with its advantage A_i [B],
    and the sequence's verdict holds for each of its tokens."""
    valid = mask > 0
    if sequence:
        return clip_predicate(sequence_mean(log_r, mask), adv, eps_low, eps_high)[:, None] & valid
    return clip_predicate(log_r, _tokens(adv), eps_low, eps_high) & valid


# ---- aggregation ---------------------------------------------------------------------------


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, max_len: int) -> torch.Tensor:
    """seq-mean    (1/B) Σ_i (1/|y_i|) Σ_t x_it          GRPO
       token-mean  Σ_it x_it / Σ_i |y_i|                 DAPO: every token weighs the same
       token-sum   Σ_it x_it / (B · max_len)             Dr.GRPO: a constant, no length bias"""
    x = _masked(per_token, mask)
    if how == "seq-mean":
        return (x.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if how == "token-mean":
        return x.sum() / mask.sum().clamp(min=1)
    if how == "token-sum":
        return x.sum() / (mask.shape[0] * max_len)
    raise ValueError(how)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on valid tokens, exactly 0 on padding, even where padding holds inf (inf·0 is nan)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


# ---- objectives ----------------------------------------------------------------------------


def _tokens(adv: torch.Tensor) -> torch.Tensor:
    return adv[:, None] if adv.dim() == 1 else adv


def ppo_clip_loss(log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  eps_low: float | None, eps_high: float | None, agg: str = "seq-mean",
                  max_len: int = 1, weights: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO-clip:  L = agg_t( w_t · −min(r_t A, clip(r_t) A) ), with behaviour weights
    w (1 without a correction). Returns (loss, clipped mask)."""
    a = _tokens(adv)
    log_r = _masked(log_r, mask)  # before exp: padding must not overflow into the gradient
    per_token = ppo_clip_token_loss(log_r, a, eps_low, eps_high)
    if weights is not None:
        per_token = per_token * weights.detach()
    clipped = clipped_tokens(log_r.detach(), adv, mask, eps_low, eps_high)
    return aggregate(per_token, mask, agg, max_len), clipped


def gspo_loss(log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              eps_low: float | None, eps_high: float | None,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the sequence's geometric-mean ratio  s_i = exp((1/|y_i|) Σ_t log r_it)  in
    L = (1/B) Σ_i w_i · −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i), with its own
    (much smaller) clip range. Returns (loss, clipped mask broadcast to the sequence's tokens)."""
    log_s = sequence_mean(log_r, mask)
    per_seq = ppo_clip_token_loss(log_s, adv, eps_low, eps_high)
    if weights is not None:
        per_seq = per_seq * sequence_mean(weights.detach(), mask)
    clipped = clipped_tokens(log_r.detach(), adv, mask, eps_low, eps_high, sequence=True)
    return per_seq.mean(), clipped


def pg_is_loss(logp_pi: torch.Tensor, log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               cap: float, agg: str = "seq-mean", max_len: int = 1,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with sequence importance sampling, no clip:
        L = agg_t( −sg(min(ρ_i, C)) · w_t · A_i · ℓ_π,it ),   ρ_i = exp(Σ_t log r_it)
    so ∇L = −min(ρ_i, C) A_i ∇ log π(y_i) (per token, aggregated); w are the behaviour weights
    of a `recompute` correction (1 without one)."""
    rho = bounded_exp(_masked(log_r.detach(), mask).sum(-1))
    w = rho.clamp(max=cap)
    per_token = -(w * adv)[:, None] * logp_pi
    if weights is not None:
        per_token = per_token * weights.detach()
    # Named apart from the recompute correction's is/*: both can be on in one run.
    stats = {mn.PG_IS_WEIGHT_MEAN_RAW: float(rho.mean()),
             mn.PG_IS_WEIGHT_MAX_RAW: float(rho.max()), mn.PG_IS_WEIGHT_MEAN: float(w.mean()),
             mn.PG_IS_FRAC_CHANGED: float((rho > cap).float().mean())}
    return aggregate(per_token, mask, agg, max_len), stats


class ValueHead(torch.nn.Module):
    """V(s_t) = w · h_t + b on the policy's last hidden state (a shared trunk), in fp32.
    Zero-initialised, so GAE starts as Monte-Carlo returns."""

    def __init__(self, width: int, device: torch.device | None = None):
        super().__init__()
        # Built on the CPU and then moved: Linear's initial draw (zeroed, but drawn) comes from
        # the CPU's random stream on every device, so later draws are the same everywhere.
        self.v = torch.nn.Linear(width, 1, device="cpu")
        torch.nn.init.zeros_(self.v.weight)
        torch.nn.init.zeros_(self.v.bias)
        self.to(device or "cpu")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return self.v(hidden.float()).squeeze(-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float | None) -> torch.Tensor:
    """PPO's clipped value loss  ½ max((V − R)², (V_old + clip(V − V_old, ±c) − R)²), token mean."""
    loss = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    return 0.5 * (loss * mask).sum() / mask.sum().clamp(min=1)


def dpo_pairs(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Online DPO pairs: in each group of a prompt's completions, the best-rewarded one is
    chosen and the worst rejected (first on ties); groups whose rewards are all equal give none.
    Returns (chosen, rejected) row indices."""
    r = rewards.view(-1, group_size)
    best, worst = r.argmax(-1), r.argmin(-1)
    keep = r.max(-1).values > r.min(-1).values
    base = torch.arange(r.shape[0], device=r.device) * group_size
    return (base + best)[keep], (base + worst)[keep]


def dpo_loss(logp_pi: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
             chosen: torch.Tensor, rejected: torch.Tensor, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO:  m = b · [(Σ ℓ_π − Σ ℓ_ref)(y_c) − (Σ ℓ_π − Σ ℓ_ref)(y_r)],  L = mean −log σ(m),
    with b the DPO temperature (`dpo_scale`; DPO's own "β", renamed here because β is the
    precision gap). Returns (loss, margins m)."""
    seq = ((logp_pi - logp_ref) * mask).sum(-1)
    m = scale * (seq[chosen] - seq[rejected])
    if m.numel() == 0:
        return (logp_pi * 0).sum(), m
    return -F.logsigmoid(m).mean(), m


# ---- each objective's loss on one minibatch -------------------------------------------------
# The registry (parity/objectives/__init__.py) names these. `share(loss, n, unit)` turns a mean
# over n items (tokens, sequences or pairs) of this piece of the minibatch into its share of the
# mean over the minibatch's items on every rank; for the whole minibatch in one process it is
# the identity. `cfg` is the run's Config, typed Any: parity/config/run.py imports the registry to
# check objective names and clip ranges, so importing Config here would make a cycle.

Share = Callable[[torch.Tensor, float, str], torch.Tensor]


def units(mask: torch.Tensor, rewards: torch.Tensor, group: int, pairs: bool) -> dict[str, float]:
    """What an objective's loss can be a mean over, counted on a minibatch (whole groups)."""
    n = {"tokens": float(mask.sum()), "sequences": float(mask.shape[0])}
    if pairs:
        n["pairs"] = float(len(dpo_pairs(rewards, group)[0]))
    return n


@dataclass(kw_only=True)
class Minibatch:
    """One minibatch as the objectives see it: [B, T] per token, [B] per completion."""
    log_r: torch.Tensor                      # log r per the ratio source
    logp_pi: torch.Tensor                    # ℓ_π, with gradient
    logp_s: torch.Tensor                     # ℓ_s (ℓ_π.detach() without a shadow)
    mask: torch.Tensor
    adv: torch.Tensor                        # [B] GRPO advantages, or [B, T] from GAE
    rewards: torch.Tensor                    # [B] (online-dpo builds its pairs from them)
    weights: torch.Tensor | None = None      # behaviour weights of a `recompute` correction
    values: torch.Tensor | None = None       # ppo-value: V on this minibatch, with gradient
    old_values: torch.Tensor | None = None   # ppo-value: V at θ_old
    returns: torch.Tensor | None = None      # ppo-value: GAE returns
    ref: torch.Tensor | None = None          # online-dpo: reference log-probs


@dataclass
class Loss:
    total: torch.Tensor                      # what backward runs on
    policy: float                            # the policy objective alone (loss/policy)
    clipped: torch.Tensor                    # [B, T] tokens on the clipped branch
    metrics: dict[str, float] = field(default_factory=dict)


def _agg_units(cfg: Any, mask: torch.Tensor) -> tuple[float, str]:
    """What a token objective's loss is a mean over: tokens for token-mean, sequences else
    (token-sum's constant B · max_len counts sequences)."""
    if cfg.loss_agg == "token-mean":
        return float(mask.sum()), "tokens"
    return float(mask.shape[0]), "sequences"


def loss_ppo_clip(cfg: Any, b: Minibatch, share: Share) -> Loss:
    loss, clipped = ppo_clip_loss(b.log_r, b.adv, b.mask, cfg.eps_low, cfg.eps_high,
                                  cfg.loss_agg, cfg.max_new_tokens, b.weights)
    loss = share(loss, *_agg_units(cfg, b.mask))
    return Loss(loss, float(loss.detach()), clipped)


def loss_ppo_value(cfg: Any, b: Minibatch, share: Share) -> Loss:
    pol = loss_ppo_clip(cfg, b, share)
    v_loss = share(value_loss(b.values, b.old_values, b.returns, b.mask, cfg.value_clip),
                   float(b.mask.sum()), "tokens")
    return Loss(pol.total + cfg.value_coef * v_loss, pol.policy, pol.clipped,
                {mn.LOSS_VALUE: float(v_loss.detach())})


def loss_gspo(cfg: Any, b: Minibatch, share: Share) -> Loss:
    loss, clipped = gspo_loss(b.log_r, b.adv, b.mask, cfg.seq_eps_low, cfg.seq_eps_high,
                              b.weights)
    loss = share(loss, float(b.mask.shape[0]), "sequences")
    return Loss(loss, float(loss.detach()), clipped)


def loss_pg_is(cfg: Any, b: Minibatch, share: Share) -> Loss:
    loss, stats = pg_is_loss(b.logp_pi, b.log_r, b.adv, b.mask, cfg.is_cap, cfg.loss_agg,
                             cfg.max_new_tokens, b.weights)
    loss = share(loss, *_agg_units(cfg, b.mask))
    return Loss(loss, float(loss.detach()), torch.zeros_like(b.mask, dtype=torch.bool), stats)


def loss_online_dpo(cfg: Any, b: Minibatch, share: Share) -> Loss:
    chosen, rejected = dpo_pairs(b.rewards, cfg.samples_per_prompt)
    loss, margins = dpo_loss(b.logp_pi, b.ref, b.mask, chosen, rejected, cfg.dpo_scale)
    loss = share(loss, float(len(chosen)), "pairs")
    margins = margins.detach()
    m = {mn.DPO_PAIRS: float(len(chosen))}
    if len(chosen):
        m[mn.DPO_MARGIN] = float(margins.mean())
        m[mn.DPO_ACCURACY] = float((margins > 0).float().mean())
        if cfg.dpo_ref == "engine":
            # With ℓ_μ as the reference the margin carries Σβ(chosen) − Σβ(rejected).
            beta_seq = ((b.logp_pi.detach() - b.logp_s) * b.mask).sum(-1)
            mb_beta = cfg.dpo_scale * (beta_seq[chosen] - beta_seq[rejected])
            m[mn.DPO_MARGIN_BETA] = float(mb_beta.mean())
            m[mn.DPO_MARGIN_BETA_ABS] = float(mb_beta.abs().mean())
    return Loss(loss, float(loss.detach()), torch.zeros_like(b.mask, dtype=torch.bool), m)
