"""The RL loop, top to bottom (notation: docs/design.md):

    sync engine ← master weights (cast to engine dtype)
    rollout: the engine samples G completions per prompt, recording ℓ_μ per token
    rewards → `prepare` (θ_old, no grad): ℓ_old for `recompute`, behaviour weights, values and
        GAE for `ppo-value`, reference log-probs for `online-dpo`; GRPO group advantages
    for each epoch, minibatch (`update`): ℓ_π (trainer dtype), ℓ_s (shadow forward, engine
        dtype, no grad) → log r per the ratio source → the objective's loss → α, β and clip
        attribution → loss-scaled backward → optimizer step on fp32 master weights (skipped on
        overflow)
    metrics.jsonl, rollout dumps, progress bar, checkpoints

The file reads in that order: `train` builds the run and drives the loop (`_train`), `rl_step`
is one step, `prepare` and `update` its two halves; then what the loop stands on: the `Run`,
`build_run` (everything a run holds: model, engine, shadow, optimizer, a resumed run's state,
the ranks' wrappers) and `save`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from parity import cpu_bf16, devices
from parity import metric_names as mn
from parity.config import Config, dump_yaml, engine_needs
from parity.diagnostics import (
    Shadow,
    StepDiagnostics,
    dump_table,
    exact_kl_of_rows,
    exact_kl_rows,
    kept_rows,
    measure,
    write_dump,
)
from parity.engines import Engine, EngineSpec, check_engine, make_engine, stop_token_ids
from parity.errors import ParityError
from parity.files import LineLog, write_failure
from parity.logprobs import Rollout, Sampling
from parity.models import invariant, lora, routing
from parity.models.forward import (
    disable_dropout,
    pieces,
    score_full,
    score_pieces,
    trimmed,
    widened,
)
from parity.models.precision import (
    LossScaler,
    backward_precision,
    fp32_head,
    torch_dtype,
    trainer_precision,
)
from parity.objectives import (
    OBJECTIVES,
    Loss,
    Minibatch,
    Objective,
    ValueHead,
    behaviour_weights,
    gae,
    grpo_advantages,
    log_ratio,
    units,
    whiten,
)
from parity.runs import checkpoints, distributed, memory, routing_gap
from parity.runs.dirs import (
    DirLock,
    check_run_dir,
    lock_run_dir,
    run_dir_for,
    set_aside_metrics,
    truncate_metrics,
)
from parity.runs.distributed import Dist, RankFailure, failure_message, full_tensor, is_comm_failure
from parity.runs.finite import Skips, first_non_finite
from parity.runs.loggers import MetricLoggers, check_backends
from parity.runs.model import ModelAndTask, load_model_and_task
from parity.runs.sources import Rollouts
from parity.runs.step_metrics import StepPart, json_safe, mean_dicts, step_metrics
from parity.tasks import PromptSampler, Task
from parity.ui import progress, say

# ---- the loop --------------------------------------------------------------------------------

def train(cfg: Config, on_model: Callable[[torch.nn.Module], None] | None = None,
          resume: bool = False) -> Path:
    """Run RL as `cfg` says; returns the run directory. All input is checked before the run
    directory is touched. With `resume`, `cfg.out` is an earlier run: it continues from its
    newest valid checkpoint, exactly as if it had not stopped. `on_model` is called with the fp32
    master model before the engine and shadow copies are made (instrumentation, fault
    injection in tests). Under torchrun / accelerate launch every rank calls this; rank 0 alone
    writes the run directory."""
    dist = distributed.init(cfg.dist_timeout_s, devices.resolve(cfg.device))
    finished = False
    try:
        with cpu_bf16.restored():
            out = _train(build_run(cfg, dist, on_model, resume), resume)
        finished = True
        return out
    except (RuntimeError, MemoryError) as e:
        if memory.out_of_memory(e):
            raise ParityError(memory.oom_message(cfg, e)) from None
        if dist.on and is_comm_failure(e):
            raise RankFailure(failure_message(e)) from None
        raise
    finally:
        dist.close(finished)


def _train(run: Run, resume: bool) -> Path:
    cfg, dist = run.cfg, run.dist
    with contextlib.ExitStack() as stack:
        stack.callback(run.rollouts.close)
        if run.lock is not None:
            stack.callback(run.lock.close)
        if dist.main:
            # Line-buffered: every finished step is on disk, whatever happens to the next one.
            # The other backends are rewound to the same step on resume, and closed however
            # the run ends.
            metrics_file = stack.enter_context(LineLog(
                run.dir / "metrics.jsonl", "metrics", "; metrics.jsonl holds every step before it "
                "and `parity train --resume RUN` continues from the newest checkpoint"))
            loggers = stack.enter_context(MetricLoggers(run.dir, run.backends, cfg.to_dict(),
                                                        run.first_step - 1 if resume else None))
        bar = stack.enter_context(progress("train", cfg.steps, cfg.progress and dist.main,
                                           run.first_step - 1, eta=True))
        t_prev = time.perf_counter()
        for step in range(run.first_step, cfg.steps + 1):
            part, own, u = rl_step(run, step)
            if run.rollouts.aeng is not None:
                # Overlapped steps: a step lasts from the end of the one before it.
                part.times[mn.STEP_S] = time.perf_counter() - t_prev
            t_prev = time.perf_counter()
            all_parts = dist.gather(part)
            run.rollouts.forget_before(step)
            if dist.main:  # rank 0 alone writes
                if u.dump:
                    # update by update, each in rank order: the one-process row order
                    write_dump(run.dir / "rollouts" / f"step-{step}.parquet",
                               [q.dump[i] for i in range(len(u.dump)) for q in all_parts])
                m = {mn.STEP: step, **step_metrics(all_parts, cfg), **own}
                if own.get(mn.ASYNC_STALENESS):
                    # |α| at the first update is the kernel gap only where the engine had the
                    # trainer's weights; a stale rollout's α holds the updates it missed.
                    m.pop(mn.KERNEL_GAP_ABS_MEAN, None)
                metrics_file.write(json.dumps(json_safe(m)) + "\n")
                loggers.log(step, m)  # after the JSONL line: a failing backend cannot lose it
                if cfg.kernels == "invariant":
                    _check_bitwise(step, m, cfg.engine_dtype)
                bar.advance(1, _step_line(m))
            if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
                save(run, step)  # on every rank: FSDP gathers the shards first
        # Before the engine closes: vLLM's shutdown tears down the process group it was
        # started in, which under torchrun is the run's own, and FSDP's gather needs it.
        # (A finished run that was "resumed" keeps its final checkpoint.)
        if run.first_step <= cfg.steps:
            save(run, cfg.steps)
    return run.dir


# kernels=invariant's promise, metric by metric: each is exactly 0 where the trainer and the
# engine computed the same bits, and each names the pair of forwards it compares; the last
# field says whether the engine's decode is one of them.
BITWISE_CHECKS = ((mn.KL_K3, "the trainer at the first update against the engine's decode", True),
                  (mn.KERNEL_GAP_ABS_MEAN, "the shadow at the first update against the "
                                           "engine's decode", True),
                  (mn.BETA_ABS_MAX, "the trainer against the shadow on the same weights", False))


def _check_bitwise(step: int, m: dict[str, Any], dtype: str = "bf16") -> None:
    """One line for a step whose figures say the two sides' bits differed (`dtype`: the run's,
    both sides'). A stale rollout (the asynchronous engine's) was sampled from older weights,
    so only the checks on one set of weights judge it."""
    stale = bool(m.get(mn.ASYNC_STALENESS))
    for name, pair, engine in BITWISE_CHECKS:
        if engine and stale:
            continue
        if m.get(name) not in (None, 0.0):
            say(f"kernels=invariant: step {step}: {name} = {m[name]:.3g}, not 0: {pair} "
                f"differ; `parity audit --engine-dtype {dtype} --trainer-dtype {dtype} "
                f"--kernels invariant --certify bitwise` names the first op that does")
            return


def _step_line(m: dict[str, Any]) -> str:
    return (f"reward {m[mn.REWARD_MEAN]:+.3f}  len {m[mn.LEN_MEAN]:.1f}  "
            f"clip {m[mn.CLIP_FRAC]:.3f}")


# ---- one step --------------------------------------------------------------------------------

def rl_step(run: Run, step: int) -> tuple[StepPart, dict[str, Any], Updates]:
    """Rollout → rewards → prepare → epochs × minibatches of updates. Returns this rank's part
    of the step's metrics, the step's own figures (rank 0 adds them) and its updates."""
    cfg, t0 = run.cfg, time.perf_counter()
    delivery = run.rollouts.get(step, run.model)
    plan, r = delivery.plan, delivery.rollout
    if run.dist.on:
        r = r.pad_to(int(run.dist.max(r.completion_ids.shape[1])), run.tok.pad_token_id)
    comp_ids = r.completions()
    texts = run.tok.batch_decode(comp_ids, skip_special_tokens=True)
    total, parts = run.task.reward_parts(plan.rows, texts, comp_ids)
    rewards = torch.tensor(total, device=run.device)
    # The engine's routing is measured against the trainer's at the first update; the
    # forwards route with it only under replay (a rollout's record is what scoring replays).
    routed = r.routed.to(run.device) if r.routed is not None else None
    if cfg.routing_replay and routed is None:
        raise ParityError(f"--routing-replay: engine={cfg.engine} returned no routing with step "
                          f"{step}'s rollout, so there is nothing to replay (its warning above "
                          f"says why)")
    r = r if cfg.routing_replay else dataclasses.replace(r, routed=None)
    data = StepData(step=step, rollout=r, rewards=rewards, prep=prepare(run, r, rewards),
                    minibatch=len(plan.rows) // cfg.minibatches, routed=routed)
    devices.synchronize(run.device)  # the stage times are the device's work, not its queueing
    t1 = time.perf_counter()
    u, skipped_before = Updates(), run.scaler.skipped
    if cfg.dump_rollouts and step % cfg.dump_rollouts == 0:
        u.dump_ids = (torch.tensor(plan.sample_ids, device=run.device),
                      torch.tensor(plan.rows, device=run.device))
    for epoch in range(cfg.epochs):
        for start in range(0, len(plan.rows), data.minibatch):
            update(run, data, epoch, start, u)
    run.rollouts.after_update(step, run.model)
    devices.synchronize(run.device)
    t2 = time.perf_counter()
    times = {mn.ROLLOUT_S: delivery.rollout_s if delivery.rollout_s is not None else t1 - t0,
             mn.TRAIN_S: t2 - t1, mn.STEP_S: t2 - t0}
    part = StepPart(rewards=total, parts=parts, n_tok=float(r.completion_mask.sum()),
                    finished=int(r.finished.sum()), diag=u.diag, prep=data.prep.metrics,
                    extras=mean_dicts(u.metrics),
                    policy_loss=sum(u.policy_losses) / len(u.policy_losses), times=times,
                    dump=u.dump)
    applied = [n for n in u.grad_norms if math.isfinite(n)]
    own = {**delivery.metrics, mn.SYNC_CHANGED_FRAC: delivery.changed,
           mn.LOSS_SCALE: run.scaler.scale,
           # over applied updates; null when the step's every update was skipped
           mn.GRAD_NORM: sum(applied) / len(applied) if applied else None,
           mn.SKIPPED_UPDATES: run.scaler.skipped,
           mn.SKIPPED_THIS_STEP: run.scaler.skipped - skipped_before}
    return part, own, u


@dataclass(kw_only=True)
class Prepared:
    """What the objective needs from θ_old, computed once per step before the first update."""
    adv: torch.Tensor                      # [B] GRPO advantages, or [B, T] from GAE
    old: torch.Tensor | None = None        # ℓ_old, recompute
    weights: torch.Tensor | None = None    # behaviour weights, recompute + correction
    old_values: torch.Tensor | None = None  # ppo-value
    returns: torch.Tensor | None = None    # ppo-value
    ref: torch.Tensor | None = None        # online-dpo reference log-probs
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def prepare(run: Run, r: Rollout, rewards: torch.Tensor) -> Prepared:
    cfg, mask, value_head = run.cfg, r.completion_mask, run.value_head
    prep = Prepared(adv=grpo_advantages(rewards, cfg.samples_per_prompt, cfg.scale_rewards))
    slices = _pieces(run, r)
    if cfg.ratio_source == "recompute" or value_head is not None:
        with _precision(run, run.model):
            sc = score_pieces(run.model, r, run.sampling, slices, hidden=value_head is not None,
                              chunk=cfg.logprob_chunk)
        if cfg.ratio_source == "recompute":
            prep.old = sc.logp
            prep.weights, prep.metrics = behaviour_weights(prep.old, r.engine_logprobs, mask,
                                                           cfg.correction, cfg.is_cap,
                                                           cfg.geo_cap, cfg.is_cap_low)
            if cfg.correction == "none":
                prep.weights = None
        if value_head is not None:
            prep.old_values = value_head(sc.hidden) * mask
            adv, prep.returns = gae(rewards, prep.old_values, mask, cfg.gae_gamma, cfg.gae_lambda)
            prep.adv = whiten(adv, mask, total=run.dist.sum)
            prep.metrics[mn.VALUE_MEAN] = float(prep.old_values.sum() / mask.sum())
    if run.objective.reference:
        if cfg.dpo_ref == "engine":
            prep.ref = r.engine_logprobs
        else:
            with _precision(run, run.ref_model):
                prep.ref = score_pieces(run.ref_model, r, run.sampling, slices,
                                        chunk=cfg.logprob_chunk).logp
    return prep


def _precision(run: Run, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The trainer's forward precision: autocast to trainer_dtype, or with kernels=invariant
    the engine's own forward, its dtype over the fp32 master weights (parity/models/
    invariant.py)."""
    cfg = run.cfg
    return trainer_precision(cfg.trainer_dtype, run.device, cfg.cpu_fp16, cfg.kernels, model)


def _pieces(run: Run, r: Rollout) -> list[slice]:
    """The micro-batches a forward over `r` is cut into (one slice: all of it at once). DPO
    pairs are made inside a group, so its pieces hold whole groups; every rank runs as many
    forwards as the most cut one, for the collectives of FSDP and of the last backward."""
    cfg = run.cfg
    if not (cfg.micro_batch or cfg.micro_batch_tokens):
        return [slice(0, r.completion_ids.shape[0])]
    group = cfg.samples_per_prompt if run.objective.pairs else 1
    slices = pieces(r, cfg.micro_batch, cfg.micro_batch_tokens, group)
    if run.dist.on:
        slices = pieces(r, cfg.micro_batch, cfg.micro_batch_tokens, group,
                        count=int(run.dist.max(len(slices))))
    return slices


@dataclass(kw_only=True)
class StepData:
    """What every update of a step reads: its rollout, rewards, and what `prepare` made of them."""
    step: int
    rollout: Rollout
    rewards: torch.Tensor
    prep: Prepared
    minibatch: int                         # rows per minibatch
    routed: torch.Tensor | None = None     # the engine's routing, [B, P + T, L, k], or None


@dataclass(kw_only=True)
class Updates:
    """What a step's updates leave behind for its metrics and its rollout dump."""
    diag: StepDiagnostics = field(default_factory=StepDiagnostics)
    policy_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    dump: list = field(default_factory=list)
    # the rows' sample and prompt ids as tensors, built once per step; None when not dumping
    dump_ids: tuple[torch.Tensor, torch.Tensor] | None = None


def update(run: Run, data: StepData, epoch: int, start: int, u: Updates) -> None:
    """One minibatch, rows [start, start + data.minibatch): its forward and backward, then what
    it leaves in `u` (the clip attribution, the diagnostics, the rollout dump, the loss and
    gradient norm), and one optimizer step."""
    cfg = run.cfg
    idx = slice(start, start + data.minibatch)
    mb, adv = data.rollout.select(idx), data.prep.adv[idx]
    # The mismatch figures (KL, sequence log-ratio, exact KL) only where the weights still
    # equal those the engine sampled with: after the step's first update they would carry the
    # policy's own move.
    first = epoch == 0 and start == 0
    batch, loss, exact_kl, own = _forward_backward(run, data, idx, mb, first)
    for kl in exact_kl:
        u.diag.add_exact_kl(kl)
    logp_pi, logp_s = batch.logp_pi.detach(), batch.logp_s
    eps_low, eps_high = run.objective.clip_range(cfg)
    att = measure(u.diag, logp_pi, logp_s, mb.engine_logprobs, adv, mb.completion_mask,
                  eps_low, eps_high, clipped=loss.clipped,
                  sequence=run.objective.clip == "sequence", first=first)
    if own is not None:   # every rank's tokens together, as one process would count them
        t = routing_gap.Tally().add(
            data.routed[idx], own[0], own[1], mb.prompt_mask, mb.completion_mask,
            routing.shape(run.model)[1], att.beta, att.phantom, logp_pi, mb.engine_logprobs)
        u.metrics.append(routing_gap.Tally.of_tensor(
            sum(run.dist.gather(t.as_tensor()))).metrics())
    if u.dump_ids is not None:
        sample_ids, prompt_ids = u.dump_ids
        u.dump.append(dump_table(data.step, len(u.policy_losses), epoch, sample_ids[idx],
                                 prompt_ids[idx], mb, adv, logp_pi, logp_s, att, eps_low,
                                 eps_high))
    applied, norm = run.scaler.step(run.opt, run.params, cfg.max_grad_norm)
    if applied:
        run.skips.applied(data.step)
    else:
        run.skips.skipped(data.step, _non_finite(run, batch, loss), _warning if run.dist.main
                          else lambda _: None)
    u.policy_losses.append(loss.policy)
    u.grad_norms.append(norm)
    u.metrics.append(loss.metrics)


def _non_finite(run: Run, batch: Minibatch, loss: Loss) -> str:
    """The first quantity of a skipped update that was NaN or inf, in the order computed."""
    i = run.scaler.bad_grad
    logp_pi = batch.logp_pi.detach().where(batch.mask > 0, 0.0)
    return first_non_finite([("l_pi", logp_pi), ("the loss", loss.total)]) or (
        f"the gradient of {run.param_names[i]}" if i is not None else "the gradient")


def _warning(message: str) -> None:
    print(f"parity: warning: {message}", file=sys.stderr)


def _forward_backward(run: Run, data: StepData, idx: slice, mb: Rollout, first: bool
                      ) -> tuple[Minibatch, Loss, list[torch.Tensor],
                                 tuple[torch.Tensor, torch.Tensor] | None]:
    """The minibatch `mb`, rows `idx` of the step, piece by piece (micro-batches, gradients
    accumulating): ℓ_π, ℓ_s, log r, the objective's loss and its backward. Returns the minibatch
    and its loss as one forward over it gives them, and, at the step's `first` update, the
    exact KL of the rows whose distribution the engine kept and, for a mixture of experts whose
    engine recorded its routing, the trainer's own routing and margins in the record's layout
    (`routing.recording`)."""
    cfg, s, prep = run.cfg, run.sampling, data.prep
    share = run.dist.sharer(units(mb.completion_mask, data.rewards[idx], cfg.samples_per_prompt,
                                  run.objective.pairs))
    slices = _pieces(run, mb)
    whole = len(slices) == 1
    done: list[Minibatch] = []
    exact_kl: list[torch.Tensor] = []
    own = _own_routing(data.routed[idx]) if first and data.routed is not None else None
    for k, sl in enumerate(slices):
        g = slice(idx.start + sl.start, idx.start + sl.stop)  # the piece's rows in the step
        piece = mb if whole else trimmed(mb.select(sl))
        t = piece.completion_ids.shape[1]
        kl_rows = kept_rows(data.rollout, g) if first else []
        local = [row - g.start for row in kl_rows]
        with (routing.recording(run.model) if own else contextlib.nullcontext()) as rec, \
                _precision(run, run.model):
            sc = score_full(run.policy, piece, s, hidden=run.value_head is not None,
                            keep_logits=local, chunk=cfg.logprob_chunk)
        if own:   # the piece's columns: its prompt trimmed from the left, completion to t
            a = mb.prompt_ids.shape[1] - piece.prompt_ids.shape[1]
            cols = slice(a, mb.prompt_ids.shape[1] + t)
            n = piece.completion_ids.shape[0]
            own[0][sl, cols], own[1][sl, cols] = rec.ids(n).to(own[0].dtype), rec.margins(n)
        logp_pi = sc.logp
        # ℓ_s on the weights ℓ_π just saw, before this update moves them.
        logp_s = (run.shadow.logprobs(run.model, piece, s, logp_pi, cast=k == 0)
                  if run.shadow else logp_pi.detach())
        log_r = log_ratio(cfg.ratio_source, logp_pi, piece.engine_logprobs, logp_s,
                          _rows(prep.old, g, t))
        batch = Minibatch(
            log_r=log_r, logp_pi=logp_pi, logp_s=logp_s, mask=piece.completion_mask,
            adv=_rows(prep.adv, g, t), rewards=data.rewards[g], weights=_rows(prep.weights, g, t),
            values=run.value(sc.hidden) if run.value_head is not None else None,
            old_values=_rows(prep.old_values, g, t), returns=_rows(prep.returns, g, t),
            ref=_rows(prep.ref, g, t))
        loss = run.objective.loss(cfg, batch, share)
        if kl_rows:
            exact_kl.append(exact_kl_of_rows(data.rollout, sc.logits, kl_rows,
                                             piece.completion_mask[local], s))
        del sc  # its kept logits, freed before the backward
        with run.dist.accumulating([run.policy, run.value], last=k == len(slices) - 1), \
                backward_precision(cfg.trainer_dtype, cfg.kernels, run.model):
            run.scaler.backward(loss.total)
        done.append(_detached(batch, mb.completion_ids.shape[1]))
    if whole:
        return batch, loss, exact_kl, own
    batch = _joined(done, mb, prep.adv[idx], data.rewards[idx])
    with torch.no_grad():  # the loss's figures over the whole minibatch
        loss = run.objective.loss(cfg, batch, share)
    return batch, loss, exact_kl, own


def _own_routing(engine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the trainer's own routing in the layout of the engine's record: ids (the
    unknown mark until a piece fills its columns) and fp32 margins."""
    return (torch.full_like(engine, torch.iinfo(engine.dtype).max),
            torch.zeros(engine.shape[:-1], dtype=torch.float32, device=engine.device))

def _rows(x: torch.Tensor | None, idx: slice, t: int | None = None) -> torch.Tensor | None:
    """Rows `idx` of a per-completion ([B]) or per-token ([B, T]) tensor; a per-token one cut
    to the first `t` columns, as a trimmed piece has them."""
    if x is None:
        return None
    return x[idx] if t is None or x.dim() == 1 else x[idx, :t]


def _detached(b: Minibatch, T: int) -> Minibatch:
    """A piece's per-token tensors without gradient, widened back to the minibatch's T."""
    w = lambda x: widened(x.detach(), T) if x is not None and x.dim() == 2 else x
    return Minibatch(**{f.name: w(getattr(b, f.name)) for f in fields(Minibatch)})


def _joined(parts: list[Minibatch], mb: Rollout, adv: torch.Tensor,
            rewards: torch.Tensor) -> Minibatch:
    """The pieces of a minibatch put back together, in row order."""
    cat = lambda name: (torch.cat([getattr(q, name) for q in parts])
                        if getattr(parts[0], name) is not None else None)
    return Minibatch(log_r=cat("log_r"), logp_pi=cat("logp_pi"), logp_s=cat("logp_s"),
                     mask=mb.completion_mask, adv=adv, rewards=rewards, weights=cat("weights"),
                     values=cat("values"), old_values=cat("old_values"),
                     returns=cat("returns"), ref=cat("ref"))


# ---- a run: everything it holds between steps, and how it is built -----------------------------

@dataclass(kw_only=True)
class Run:
    cfg: Config
    dist: Dist
    dir: Path
    objective: Objective
    model: torch.nn.Module              # fp32 master weights (FSDP-sharded under fsdp)
    policy: Any                         # the model as forwards with gradient see it (DDP)
    tok: Any
    task: Task
    engine: Engine
    shadow: Shadow | None
    value_head: ValueHead | None
    value: Any                          # the value head as forwards with gradient see it
    ref_model: torch.nn.Module | None   # online-dpo's frozen initial policy
    scaler: LossScaler
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    param_names: list[str]              # of `params`, for a message
    skips: Skips
    rollouts: Rollouts
    sampling: Sampling
    device: torch.device
    first_step: int
    fsdp: bool
    backends: list[str] = field(default_factory=list)
    lock: DirLock | None = None        # rank 0: the run directory, held for the run's life


def build_run(cfg: Config, dist: Dist, on_model: Callable[[torch.nn.Module], None] | None,
              resume: bool) -> Run:
    """Everything a run needs before its first step, on the rank's device (`dist.device`): the
    run planned and checked (`plan_run`), then made. The order of construction is the order
    the random streams are drawn in: a resumed or repeated run depends on it."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    plan = plan_run(cfg, dist, resume)
    run_dir, restored, lock = plan.run_dir, plan.restored, plan.lock
    model, tok, model_dir, task = (plan.loaded.model, plan.loaded.tok, plan.loaded.model_dir,
                                   plan.loaded.task)
    if cfg.lora_rank:
        model = lora.wrap(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_merge,
                          torch_dtype(cfg.base_dtype))
    if dist.main and not resume:
        lock = _start_run_dir(cfg, run_dir, model_dir, task)
    model.to(dist.device)  # before the copies: the engine, shadow and reference are made from it
    obj = OBJECTIVES[cfg.objective]
    if cfg.lm_head_fp32:
        fp32_head(model)
    if on_model is not None:
        on_model(model)
    if cfg.kernels == "invariant":   # before the engine's and the shadow's copies are made
        invariant.use(model)
    engine = _make_engine(cfg, model, model_dir, tok, task, dist.world)
    copies = _model_copies(cfg, model, obj, engine, dist.device)
    state = _loop_state(cfg, task, dist.device, restored, model, engine, copies.value_head)
    value_head = copies.value_head
    if dist.main and resume:
        _rewind_run_dir(run_dir, restored)
    # Forward passes with gradient go through DDP (or the FSDP-sharded model itself), which
    # averages the gradients over ranks.
    fsdp = dist.on and cfg.parallel == "fsdp"
    if fsdp:
        dist.fully_shard(model)  # before the optimizer: its state lives on the shards
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    named += [(f"value_head.{n}", p) for n, p in value_head.named_parameters()] \
        if value_head is not None else []
    params = [p for _, p in named]
    opt = make_optimizer(cfg, params)
    if state.opt_state is not None:
        _load_optimizer_state(opt, model, state.opt_state, fsdp, restored)
    s = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    kl_rows = exact_kl_rows(cfg.prompts_per_step * cfg.samples_per_prompt, cfg.kl_exact_rows)
    first_step = restored.step + 1 if restored is not None else 1
    rollouts = Rollouts(cfg, task, engine, dist, s, state.prompts, state.gen, kl_rows, first_step,
                        restored)
    return Run(cfg=cfg, dist=dist, dir=run_dir, objective=obj, model=model,
               policy=model if fsdp else dist.wrap(model), tok=tok, task=task, engine=engine,
               shadow=copies.shadow, value_head=value_head, value=dist.wrap(value_head),
               ref_model=copies.ref_model, scaler=state.scaler, opt=opt, params=params,
               param_names=[n for n, _ in named],
               skips=Skips(cfg.max_consecutive_skips, last_applied=first_step - 1),
               rollouts=rollouts, sampling=s, device=dist.device, first_step=first_step, fsdp=fsdp,
               backends=plan.backends, lock=lock)


@dataclass(kw_only=True)
class Plan:
    """What a run is, checked before anything is written: its directory (held, when resumed),
    the checkpoint it resumes from, its logging backends, and its model and task, loaded."""
    run_dir: Path
    restored: checkpoints.Restored | None
    backends: list[str]
    loaded: ModelAndTask
    lock: DirLock | None          # rank 0, resuming: the run directory, held from here on


def plan_run(cfg: Config, dist: Dist, resume: bool) -> Plan:
    """Rank 0 checks the run directory and builds the testbed's caches; the others follow, and
    a refusal on rank 0 stops every rank. Every check, the memory check included, comes before
    a new run's directory exists; a resumed run's directory is held before it is read."""
    if cfg.prompts_per_step % (cfg.minibatches * dist.world):
        raise ParityError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by "
                          f"minibatches x ranks = {cfg.minibatches} x {dist.world}: every rank "
                          f"takes whole prompt groups of every minibatch")
    run_dir = run_dir_for(cfg) if dist.main else Path()
    run_dir = Path(dist.gather(str(run_dir))[0])
    error, restored, loaded, backends, lock = None, None, None, [], None
    if dist.main:
        try:
            lock = lock_run_dir(run_dir, new=False) if resume else None
            restored = checkpoints.latest_valid(run_dir) if resume else None
            if not resume:
                check_run_dir(run_dir)
            backends = check_backends(cfg.report_to)  # a requested one not installed fails here
            check_engine(cfg.engine)   # before a model is loaded or built
            loaded = load_model_and_task(cfg)
            routing.check_replay(loaded.model, cfg.routing_replay, cfg.model)
            check_engine(cfg.engine, loaded.model.config, dataclasses.replace(
                engine_needs(cfg), max_len=loaded.longest_prompt() + cfg.max_new_tokens,
                scores=cfg.shadow_kernels == "scored" and (cfg.diagnostics or _needs_shadow(cfg))))
            if warning := memory.check(cfg, loaded.model, loaded.longest_prompt(), dist.world,
                                       dist.device):
                print(f"parity: warning: {warning}", file=sys.stderr)
        except ParityError as e:
            error = str(e)
            if lock is not None:
                lock.close()
    dist.agree(error)
    restored = dist.gather(restored)[0]
    if loaded is None:
        loaded = load_model_and_task(cfg)
    return Plan(run_dir=run_dir, restored=restored, backends=backends, loaded=loaded, lock=lock)


def _start_run_dir(cfg: Config, run_dir: Path, model_dir: Path, task: Task) -> DirLock:
    lock = lock_run_dir(run_dir, new=True)
    try:
        dump_yaml(cfg, run_dir / "config.yaml")
        (run_dir / "task.json").write_text(json.dumps(
            {"task": task.name, "model_dir": str(model_dir), "rows": len(task.rows), **task.info},
            indent=1))
    except OSError as e:
        raise write_failure(e, run_dir, 1 << 16, "the run directory") from None
    return lock


def _make_engine(cfg: Config, model: torch.nn.Module, model_dir: Path, tok: Any, task: Task,
                 world: int) -> Engine:
    rows = cfg.prompts_per_step * cfg.samples_per_prompt // world
    return make_engine(cfg.engine, EngineSpec(
        model, str(model_dir), cfg.engine_dtype, stop_token_ids(model, tok), tok.pad_token_id,
        cfg.seed, max(map(len, task.prompt_ids)) + cfg.max_new_tokens,
        min(rows, cfg.rollout_batch or rows), cfg.cpu_fp16, cfg.lm_head_fp32,
        cfg.vllm_gpu_memory, cfg.vllm_cuda_graphs))


@dataclass
class Copies:
    """What is made beside the master model."""
    value_head: ValueHead | None        # ppo-value
    ref_model: torch.nn.Module | None   # online-dpo's frozen initial policy
    shadow: Shadow | None               # the engine-precision forward on the trainer's weights


def _model_copies(cfg: Config, model: torch.nn.Module, obj: Objective, engine: Engine,
                  device: torch.device) -> Copies:
    """The master model in training mode, and what is made beside it: the value head
    (ppo-value), the frozen initial policy (online-dpo) and the shadow."""
    model.train()
    if not cfg.keep_dropout:
        disable_dropout(model)
    value_head = ValueHead(model.config.hidden_size, device) if obj.value_head else None
    ref_model = (copy.deepcopy(model).eval().requires_grad_(False)
                 if obj.reference and cfg.dpo_ref == "initial" else None)
    shadow = (Shadow(model, cfg.engine_dtype, cfg.trainer_dtype, cfg.cpu_fp16, cfg.lm_head_fp32,
                     cfg.logprob_chunk, cfg.shadow_kernels, engine)
              if cfg.diagnostics or _needs_shadow(cfg) else None)
    if cfg.gradient_checkpointing:  # after the copies: they only ever run without gradient
        # transformers 5 renamed it; the project still accepts 4.x, which has the old name only
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    return Copies(value_head, ref_model, shadow)


def _needs_shadow(cfg: Config) -> bool:
    """The shadow ratio and DPO's engine reference need ℓ_s whether or not diagnostics are on."""
    return cfg.ratio_source == "shadow" or (OBJECTIVES[cfg.objective].reference
                                            and cfg.dpo_ref == "engine")


@dataclass
class LoopState:
    """The loop's state, new or as a checkpoint left it."""
    scaler: LossScaler
    prompts: PromptSampler              # the data order
    gen: torch.Generator                # the sampling stream
    opt_state: dict | None              # to load once the optimizer exists; None: a new run


def _loop_state(cfg: Config, task: Task, device: torch.device,
                restored: checkpoints.Restored | None, model: torch.nn.Module, engine: Engine,
                value_head: ValueHead | None) -> LoopState:
    """The loss scaler, the data order and the sampling generator, new or as `restored` left
    them (its weights loaded into the model, the engine and the value head on the way); and the
    optimizer state to load once the optimizer exists (None for a new run)."""
    scaler = LossScaler(cfg.trainer_dtype, device, cfg.loss_scale_init,
                        cfg.loss_scale_growth_interval)
    prompts = PromptSampler(len(task.rows), cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # on the CPU on every device: devices.py
    if restored is None:
        return LoopState(scaler, prompts, gen, None)
    train_state = checkpoints.load_into(restored, model, engine, gen, value_head)
    scaler.load_state_dict(train_state["scaler"])
    prompts.load_state_dict(restored.state["prompts"])
    engine.version = restored.state["engine_version"]
    return LoopState(scaler, prompts, gen, train_state["optimizer"])


def _rewind_run_dir(run_dir: Path, restored: checkpoints.Restored | None) -> None:
    """A resumed run's directory as its checkpoint left it: the steps logged after it dropped and
    a checkpoint write the crash interrupted removed; with no checkpoint to resume from, the
    steps logged are set aside and the run starts again."""
    if restored is None:
        if kept := set_aside_metrics(run_dir):
            print(f"parity: warning: the steps {run_dir} had logged are kept in {kept.name}",
                  file=sys.stderr)
        return
    truncate_metrics(run_dir / "metrics.jsonl", restored.step)
    for stale in (run_dir / "checkpoints").glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr)


def _load_optimizer_state(opt: torch.optim.Optimizer, model: torch.nn.Module, state: dict,
                          fsdp: bool, restored: checkpoints.Restored) -> None:
    if not fsdp:
        opt.load_state_dict(state)
    elif any(isinstance(k, int) for k in state.get("state", {})):
        raise ParityError(f"{restored.path} was written by a one-process run, whose optimizer "
                          f"state FSDP cannot load: resume it with one process, as it was "
                          f"started")
    else:
        # start-up time: torch's distributed checkpointing takes over a second to import
        # (python -X importtime -c "import parity.trainer"), and only FSDP needs it
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


# ---- checkpoints -----------------------------------------------------------------------------

def save(run: Run, step: int) -> None:
    """Called on every rank: under FSDP each gathers its shards first; rank 0 writes."""
    model_state = opt_state = None
    if run.fsdp:
        # start-up time, as in _load_optimizer_state
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        model_state = {k: full_tensor(v) for k, v in run.model.state_dict().items()}
        opt_state = get_optimizer_state_dict(run.model, run.opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    if not run.dist.main:
        return
    checkpoints.save(run.dir, step, run.model, run.tok, run.engine, run.engine.version,
                     run.opt, run.scaler.state_dict(), value_head=run.value_head,
                     keep=run.cfg.keep_checkpoints, model_state=model_state, opt_state=opt_state,
                     **run.rollouts.saved_states(step))
