"""Every metric name parity writes, defined once: the constants the code writes and reads, and
the registry docs/design.md's metrics table is rendered from (tests/test_metric_names.py holds
the doc to `metrics_table()` and a real run's keys to the registry).

The names are a contract (scripts, dashboards and recorded runs read them), so a name changes
here or nowhere. A family's name is a `str.format` pattern (`rewards/{fn}/mean`): the code fills
it in, the registry matches any value in its place. Imports nothing, so the command line and the
docs tests load it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STEP = "step"
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_FN_MEAN = "rewards/{fn}/mean"
LEN_MEAN = "completion/len_mean"
EOS_FRAC = "completion/eos_frac"

CLIP = "clip/"
CLIP_FRAC = "clip/frac"
PHANTOM_FRAC = "clip/phantom_frac"
HIDDEN_FRAC = "clip/hidden_frac"
ALPHA_CLIP_FRAC = "clip/alpha_frac"
# The audit's phantom-clipped share at one ε of its sweep (`phantom_vs_eps`), named for the
# reference points advice.py sets it against: no metrics file holds it under this name.
PHANTOM_AT_EPS = PHANTOM_FRAC + "@{eps}"

ALPHA_MEAN = "mismatch/alpha_mean"
ALPHA_ABS_MEAN = "mismatch/alpha_abs_mean"
KERNEL_GAP_ABS_MEAN = "mismatch/kernel_gap_abs_mean"
BETA_MEAN = "mismatch/beta_mean"
BETA_ABS_MEAN = "mismatch/beta_abs_mean"
BETA_STD = "mismatch/beta_std"
BETA_ABS_MAX = "mismatch/beta_abs_max"
BETA_MEAN_SE = "mismatch/beta_mean_se"
BETA_ADV_CORR = "mismatch/beta_adv_corr"
BETA_ADV_CORR_SE = "mismatch/beta_adv_corr_se"
BETA_BY_PROB = "beta_by_prob/{bucket}/{stat}"
BETA_BY_POS = "beta_by_pos/{bucket}/{stat}"
KL_K1 = "mismatch/kl_k1"
KL_K3 = "mismatch/kl_k3"
PROB_DIFF_ABS_MEAN = "mismatch/prob_diff_abs_mean"
PROB_DIFF_MAX = "mismatch/prob_diff_max"
PROB_DIFF_MIN = "mismatch/prob_diff_min"
LOG_RATIO_ABS_MEAN = "mismatch/log_ratio_abs_mean"
LOG_RATIO_ABS_MAX = "mismatch/log_ratio_abs_max"
KL_EXACT = "mismatch/kl_exact"
KL_EXACT_POSITIONS = "mismatch/kl_exact_positions"
SEQ_LOG_RATIO_MEAN = "mismatch/seq_log_ratio_mean"
SEQ_LOG_RATIO_SLOPE = "mismatch/seq_log_ratio_slope"
NON_FINITE_TOKENS = "mismatch/non_finite_tokens"
POSITIVE_TOKENS = "mismatch/positive_tokens"

ROUTING_FLIP_FRAC = "routing/flip_frac"
ROUTING_FLIP_FRAC_LAYER = "routing/flip_frac_layer/{layer}"
ROUTING_TOKEN_FLIP_FRAC = "routing/token_flip_frac"
ROUTING_MARGIN_MEAN = "routing/margin_mean"
ROUTING_MARGIN_AT_FLIPS = "routing/margin_at_flips"
ROUTING_BETA_ABS_FLIPPED = "routing/beta_abs_flipped"
ROUTING_BETA_ABS_UNFLIPPED = "routing/beta_abs_unflipped"
ROUTING_PHANTOM_FLIPPED_SHARE = "routing/phantom_flipped_share"
ROUTING_KL_K3_FLIPPED_SHARE = "routing/kl_k3_flipped_share"

SYNC_CHANGED_FRAC = "sync/changed_frac"
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_SCALE = "loss/scale"
IS_WEIGHT_MEAN_RAW = "is/weight_mean_raw"
IS_WEIGHT_MAX_RAW = "is/weight_max_raw"
IS_WEIGHT_MIN_RAW = "is/weight_min_raw"
IS_WEIGHT_MEAN = "is/weight_mean"
IS_FRAC_CHANGED = "is/frac_changed"
PG_IS_WEIGHT_MEAN_RAW = "pg_is/weight_mean_raw"
PG_IS_WEIGHT_MAX_RAW = "pg_is/weight_max_raw"
PG_IS_WEIGHT_MEAN = "pg_is/weight_mean"
PG_IS_FRAC_CHANGED = "pg_is/frac_changed"
VALUE_MEAN = "value/mean"
DPO_PAIRS = "dpo/pairs"
DPO_MARGIN = "dpo/margin"
DPO_ACCURACY = "dpo/accuracy"
DPO_MARGIN_BETA = "dpo/margin_beta"
DPO_MARGIN_BETA_ABS = "dpo/margin_beta_abs"
GRAD_NORM = "train/grad_norm"
SKIPPED_UPDATES = "train/skipped_updates"
SKIPPED_THIS_STEP = "train/skipped_this_step"
ROLLOUT_S = "time/rollout_s"
TRAIN_S = "time/train_s"
STEP_S = "time/step_s"
TOKENS_PER_S = "throughput/tokens_per_s"
SYNC_S = "time/sync_s"
ASYNC_STALENESS = "async/staleness"
ASYNC_ENGINE_VERSION = "async/engine_version"
ASYNC_WAIT_S = "async/wait_s"

# The TRL integrations' own names, logged beside TRL's (docs/trl.md, docs/trl-async.md).
SYNC_WRITE_S = "sync/write_s"
SYNC_RELOAD_S = "sync/reload_s"
SYNC_BYTES = "sync/bytes"
SYNC_PROBE_GAP_ABS_MEAN = "sync/probe_gap_abs_mean"
SYNC_PROBE_MOVED_ABS_MEAN = "sync/probe_moved_abs_mean"
SHADOW_S = "time/shadow_s"


@dataclass(frozen=True)
class Metric:
    name: str          # the key, or a family's pattern
    unit: str
    absent: str = ""   # when the key is not written; "" for every step


@dataclass(frozen=True)
class Row:
    """Names documented together: one line of docs/design.md's table, one meaning for all."""
    metrics: tuple[Metric, ...]
    meaning: str


def _row(meaning: str, *metrics: tuple[str, ...]) -> Row:
    return Row(tuple(Metric(*m) for m in metrics), meaning)


TOKENS_NATS = "nats per token"
NO_TOKENS = "a step with no valid completion token"
ASYNC_ONLY = "without `--async-engine`"
AUDIT_ONLY = "`parity train` (an audit's metrics only)"
MOE_ONLY = "a dense model, or an engine that returns no routing"

# docs/design.md's table, in its order.
ROWS: tuple[Row, ...] = (
    _row("the RL step, from 1", (STEP, "count")),
    _row("over the step's completions; per reward function when there are several",
         (REWARD_MEAN, "the task's reward"), (REWARD_STD, "the task's reward"),
         (REWARD_FN_MEAN, "the task's reward", "a task with one reward function")),
    _row("completion tokens (EOS counted); share ending with EOS",
         (LEN_MEAN, "tokens"), (EOS_FRAC, "share of completions")),
    _row("shares of valid completion tokens over every update of the step: on PPO's clipped "
         "branch; clipped only because of β (C(α+β, A) and not C(α, A)); let through only "
         "because of β (the reverse); clipped by α alone, the true trust-region clip",
         *((n, "share of tokens", NO_TOKENS)
           for n in (CLIP_FRAC, PHANTOM_FRAC, HIDDEN_FRAC, ALPHA_CLIP_FRAC))),
    _row("α = ℓ_s − ℓ_μ, the policy change in engine precision",
         (ALPHA_MEAN, TOKENS_NATS, NO_TOKENS), (ALPHA_ABS_MEAN, TOKENS_NATS, NO_TOKENS)),
    _row("mean \\|α\\| on the step's first update, where θ = θ_old: the engine's decode kernels "
         "against the shadow's full forward",
         (KERNEL_GAP_ABS_MEAN, TOKENS_NATS, "a stale asynchronous rollout, where α also holds "
          "the updates the engine missed")),
    _row("β = ℓ_π − ℓ_s, the precision gap on the same weights; its mean is about −KL(μ‖π)",
         *((n, TOKENS_NATS, NO_TOKENS) for n in (BETA_MEAN, BETA_ABS_MEAN, BETA_STD,
                                                 BETA_ABS_MAX))),
    _row("standard error of β's mean, each completion one draw (cluster-robust)",
         (BETA_MEAN_SE, TOKENS_NATS, NO_TOKENS)),
    _row("Pearson correlation of β with the advantage",
         (BETA_ADV_CORR, "correlation, −1 to 1", "β or the advantages do not vary")),
    _row("its standard error, each completion one draw: a completion's tokens share one "
         "advantage",
         (BETA_ADV_CORR_SE, "correlation", "β or the advantages do not vary")),
    _row("β by trainer token probability, buckets 0, 0.1, 0.5, 0.9, 0.99, 1; `stat` is `mean`, "
         "`abs_mean` or `tokens`",
         (BETA_BY_PROB, "nats per token; `tokens`: count", "a bucket with no token")),
    _row("β by completion position, buckets 0, 8, 32, 128, 512+; `stat` as above",
         (BETA_BY_POS, "nats per token; `tokens`: count", "a bucket with no token")),
    _row("token means of `ℓ_μ − ℓ_π` and `exp(Δ) − Δ − 1`, `Δ = ℓ_π − ℓ_μ`; k3 takes `Δ` at "
         "`min(Δ, 80)`, so one token adds at most e^80 ≈ 5.5e34 (docs/diagnostics.md)",
         (KL_K1, TOKENS_NATS, NO_TOKENS), (KL_K3, TOKENS_NATS, NO_TOKENS)),
    _row("`exp(ℓ_π) − exp(ℓ_μ)`",
         *((n, "probability", NO_TOKENS)
           for n in (PROB_DIFF_ABS_MEAN, PROB_DIFF_MAX, PROB_DIFF_MIN))),
    _row("\\|ℓ_π − ℓ_μ\\| = \\|α + β\\| at θ = θ_old, the engine's whole gap to the trainer",
         (LOG_RATIO_ABS_MEAN, TOKENS_NATS, AUDIT_ONLY),
         (LOG_RATIO_ABS_MAX, TOKENS_NATS, AUDIT_ONLY)),
    _row("KL(μ‖π) over the whole vocabulary at the first positions of `kl_exact_rows` "
         "completions, as many as 64 MiB of fp32 hold a row (110 at Qwen3's vocabulary; the "
         "engine keeps the distribution it sampled from as a tensor, vLLM's read from its "
         "sampler; the trainer's come from its own forward); the number of positions",
         (KL_EXACT, "nats per position", "`kl_exact_rows: 0`; vLLM's Model Runner V2"),
         (KL_EXACT_POSITIONS, "count", "`kl_exact_rows: 0`; vLLM's Model Runner V2")),
    _row("`Σ_t (ℓ_π − ℓ_μ)` per completion; its least-squares slope against length",
         (SEQ_LOG_RATIO_MEAN, "nats per completion"),
         (SEQ_LOG_RATIO_SLOPE, "nats per token of length", "completions all of one length")),
    _row("token log-probs (ℓ_μ, ℓ_π, ℓ_s or ℓ_old) that were NaN or inf, left out of every "
         "figure above",
         (NON_FINITE_TOKENS, "count", "every log-prob finite")),
    _row("token log-probs (ℓ_μ, ℓ_π, ℓ_s or ℓ_old), finite, above 1e-3: no log-prob is "
         "positive, so these are something else, logits most often; left out of every figure "
         "above",
         (POSITIVE_TOKENS, "count", "no log-prob above 1e-3")),
    _row("a mixture of experts' routing on the step's first update: the share of router "
         "decisions (position × MoE layer) where the trainer's own top-k differs from the "
         "engine's recorded one, overall and by MoE layer (from 0); the share of completion "
         "tokens whose predicting position flipped in any layer (docs/moe.md)",
         (ROUTING_FLIP_FRAC, "share of decisions", MOE_ONLY),
         (ROUTING_FLIP_FRAC_LAYER, "share of decisions", MOE_ONLY),
         (ROUTING_TOKEN_FLIP_FRAC, "share of tokens", MOE_ONLY)),
    _row("the trainer's router margin, its k-th largest logit minus the (k+1)-th: over every "
         "decision, and at the flips",
         (ROUTING_MARGIN_MEAN, "router logit", MOE_ONLY),
         (ROUTING_MARGIN_AT_FLIPS, "router logit", MOE_ONLY + "; no flip")),
    _row("mean \\|β\\| on tokens with a flip and on tokens without; the flipped tokens' share "
         "of the phantom clips and of k3's sum",
         (ROUTING_BETA_ABS_FLIPPED, TOKENS_NATS, MOE_ONLY + "; no flip"),
         (ROUTING_BETA_ABS_UNFLIPPED, TOKENS_NATS, MOE_ONLY),
         (ROUTING_PHANTOM_FLIPPED_SHARE, "share of phantom clips", MOE_ONLY + "; no phantom clip"),
         (ROUTING_KL_K3_FLIPPED_SHARE, "share of k3", MOE_ONLY)),
    _row("share of engine-precision weights changed at this step's sync",
         (SYNC_CHANGED_FRAC, "share of weights")),
    _row("the policy objective's loss alone, mean over the step's updates",
         (LOSS_POLICY, "the objective's loss")),
    _row("the clipped value loss before the `value_coef` weight, reported apart from "
         "`loss/policy`",
         (LOSS_VALUE, "squared reward units", "an objective other than `ppo-value`")),
    _row("the fp16 dynamic loss scale (1 for other dtypes)", (LOSS_SCALE, "factor")),
    _row("behaviour weights of a `recompute` correction, before and after truncation or "
         "masking; each `exp` of a log-ratio at `min(·, 80)`, so a raw weight is at most e^80",
         *((n, "importance weight", "no `recompute` correction")
           for n in (IS_WEIGHT_MEAN_RAW, IS_WEIGHT_MAX_RAW, IS_WEIGHT_MIN_RAW, IS_WEIGHT_MEAN)),
         (IS_FRAC_CHANGED, "share of tokens or completions", "no `recompute` correction")),
    _row("`pg-is`'s sequence weights, `exp(min(Σ_t log r, 80))` before the cap",
         *((n, "importance weight", "an objective other than `pg-is`")
           for n in (PG_IS_WEIGHT_MEAN_RAW, PG_IS_WEIGHT_MAX_RAW, PG_IS_WEIGHT_MEAN)),
         (PG_IS_FRAC_CHANGED, "share of completions", "an objective other than `pg-is`")),
    _row("mean old value over valid tokens",
         (VALUE_MEAN, "the task's reward", "an objective other than `ppo-value`")),
    _row("the last two with `dpo_ref: engine`: the part of the margin that β carries",
         (DPO_PAIRS, "count", "an objective other than `online-dpo`"),
         (DPO_MARGIN, "nats, times `dpo_scale`", "no pair, or not `online-dpo`"),
         (DPO_ACCURACY, "share of pairs", "no pair, or not `online-dpo`"),
         (DPO_MARGIN_BETA, "nats, times `dpo_scale`", "no pair, or not `dpo_ref: engine`"),
         (DPO_MARGIN_BETA_ABS, "nats, times `dpo_scale`", "no pair, or not `dpo_ref: engine`")),
    _row("gradient norm before clipping over applied updates (null if none); updates skipped "
         "for a non-finite gradient, in total and this step",
         (GRAD_NORM, "L2 norm"), (SKIPPED_UPDATES, "count"), (SKIPPED_THIS_STEP, "count")),
    _row("wall time of sampling + rewards, of the updates, of the step (with `--async-engine`: "
         "the engine process's time on the rollout, the trainer's on the step, and the time "
         "between two steps' ends; across ranks the slowest rank's); completion tokens per "
         "second of step time",
         (ROLLOUT_S, "seconds"), (TRAIN_S, "seconds"), (STEP_S, "seconds"),
         (TOKENS_PER_S, "tokens per second")),
    _row("the weight sync's wall time (cast to engine precision, and vLLM's reload), inside "
         "`time/rollout_s`", (SYNC_S, "seconds", "with `--async-engine`")),
    _row("how many optimizer steps older than the trainer's the rollout's weights were (≤ "
         "`max_staleness`), their version, and how long the trainer waited for the rollout",
         (ASYNC_STALENESS, "optimizer steps", ASYNC_ONLY),
         (ASYNC_ENGINE_VERSION, "optimizer steps", ASYNC_ONLY),
         (ASYNC_WAIT_S, "seconds", ASYNC_ONLY)),
)

TRL_ONLY = "parity's own trainer (the TRL integrations' log only)"
# Logged by the TRL integrations alone, never in metrics.jsonl (docs/trl.md, docs/trl-async.md).
TRL_ROWS: tuple[Row, ...] = (
    _row("parity's weight sync to a server: its write, the server's reload, the bytes sent",
         (SYNC_WRITE_S, "seconds", TRL_ONLY), (SYNC_RELOAD_S, "seconds", TRL_ONLY),
         (SYNC_BYTES, "bytes", TRL_ONLY)),
    _row("the server against the trainer's forward of the same weights on a probe (the kernel "
         "gap); how far the server's probe log-probs moved since the last sync",
         (SYNC_PROBE_GAP_ABS_MEAN, TOKENS_NATS, TRL_ONLY),
         (SYNC_PROBE_MOVED_ABS_MEAN, TOKENS_NATS, TRL_ONLY)),
    _row("what the shadow cost per loss call", (SHADOW_S, "seconds", TRL_ONLY)),
)

REGISTRY: tuple[Metric, ...] = tuple(m for row in ROWS + TRL_ROWS for m in row.metrics)


def prefix(pattern: str) -> str:
    """What every name of a family starts with: its pattern up to the first placeholder."""
    return pattern.split("{", 1)[0]


def _pattern(name: str) -> re.Pattern:
    parts = re.split(r"\{[a-z]+\}", name)
    return re.compile("[^/]+".join(re.escape(p) for p in parts) + r"\Z")


_PATTERNS = [(_pattern(m.name), m) for m in REGISTRY]


def entry(key: str) -> Metric | None:
    """The registry's entry for a written key (a family's for a filled-in pattern), or None."""
    return next((m for pat, m in _PATTERNS if pat.match(key)), None)


def _cell(metrics: tuple[Metric, ...], attr: str, none: str) -> str:
    """One value for the row when its names share it, else each value after its names (their
    last parts where those tell them apart), in the names' order: `a`, `b`: x; `c`: y."""
    short = [m.name.rsplit("/", 1)[-1] for m in metrics]
    if len(set(short)) < len(short):
        short = [m.name for m in metrics]
    groups: dict[str, list[str]] = {}
    for m, name in zip(metrics, short):
        groups.setdefault(getattr(m, attr) or none, []).append(name)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(", ".join(f"`{n}`" for n in names) + f": {v}" for v, names in groups.items())


def metrics_table() -> str:
    """docs/design.md's metrics table, as Markdown."""
    lines = ["| name | meaning | unit | absent |", "|---|---|---|---|"]
    for row in ROWS:
        names = ", ".join(f"`{m.name}`" for m in row.metrics)
        lines.append(f"| {names} | {row.meaning} | {_cell(row.metrics, 'unit', '')} | "
                     f"{_cell(row.metrics, 'absent', 'never')} |")
    return "\n".join(lines) + "\n"


# ---- the same figures under other frameworks' names ---------------------------------------------

@dataclass(frozen=True)
class Elsewhere:
    """One of parity's figures and the other frameworks' name for the very same quantity; "—"
    where a framework logs none. docs/diagnostics.md's table is rendered from ELSEWHERE."""
    name: str
    quantity: str
    trl: str = "—"
    verl: str = "—"
    slime: str = "—"
    prime_rl: str = "—"
    nemo_rl: str = "—"


FRAMEWORKS = (("TRL", "trl"), ("verl", "verl"), ("slime", "slime"), ("prime-rl", "prime_rl"),
              ("NeMo-RL", "nemo_rl"))
ELSEWHERE: tuple[Elsewhere, ...] = (
    Elsewhere(LOG_RATIO_ABS_MEAN, "mean \\|Δ\\|", trl="sampling/sampling_logp_difference/mean",
              slime="train/train_rollout_logprob_abs_diff"),
    Elsewhere(LOG_RATIO_ABS_MAX, "max \\|Δ\\|", trl="sampling/sampling_logp_difference/max"),
    Elsewhere(PROB_DIFF_ABS_MEAN, "mean \\|exp ℓ_π − exp ℓ_μ\\|",
              verl="training/rollout_probs_diff_mean"),
    Elsewhere(KL_K1, "mean of ℓ_μ − ℓ_π", verl="rollout_corr/kl", slime="train/mis_kl"),
    Elsewhere(KL_K3, "mean of exp(Δ) − Δ − 1", verl="rollout_corr/k3_kl",
              slime="train/mis_k3_kl", prime_rl="mismatch_kl",
              nemo_rl="train/gen_kl_error (its default k3)"),
    Elsewhere(CLIP_FRAC, "share of tokens on PPO's clipped branch, C(log r, A)",
              trl="clip_ratio/region_mean", verl="actor/pg_clipfrac"),
    Elsewhere(IS_WEIGHT_MEAN_RAW, "mean of ρ_t = exp(ℓ_old − ℓ_μ) before any cap",
              nemo_rl="train/sampling_importance_ratio"),
    Elsewhere(IS_FRAC_CHANGED, "share of tokens a masking correction zeroes (IcePop: outside "
              "its bounds)", verl="rollout_corr/rollout_is_oob_ratio",
              prime_rl="is_masked_* (one per mask)"),
)


def elsewhere_table() -> str:
    """docs/diagnostics.md's "The same metrics elsewhere" table, as Markdown."""
    head = ["parity", "quantity", *(label for label, _ in FRAMEWORKS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in ELSEWHERE:
        cells = [f"`{e.name}`", e.quantity] + [
            v if v == "—" else f"`{v.split(' (')[0]}`" + (f" ({v.split(' (', 1)[1]}"
                                                       if " (" in v else "")
            for v in (getattr(e, attr) for _, attr in FRAMEWORKS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
