"""The RL loop, top to bottom:

    sync engine ← master weights (cast to engine dtype)
    rollout: the engine samples G completions per prompt, recording ℓ_μ per token
    rewards → `prepare` (θ_old, no grad): ℓ_old for `recompute`, behaviour weights, values and
        GAE for `ppo-value`, reference log-probs for `online-dpo`; GRPO group advantages
    for each epoch, minibatch: ℓ_π (trainer dtype), ℓ_s (shadow forward, engine dtype, no grad)
        → log r per the ratio source → the objective's loss → α, β and clip attribution →
        loss-scaled backward → optimizer step on fp32 master weights (skipped on overflow)
    metrics.jsonl, rollout dumps, progress bar, checkpoints
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity import checkpoints, distributed, testbed, vllm_engine
from parity.async_engine import AsyncEngine, Request
from parity.config import Config, dump_yaml
from parity.distributed import Dist, RankFailure, failure_message, full_tensor, is_comm_failure
from parity.diagnostics import (Shadow, StepDiagnostics, attribute, dump_table, exact_kl_of_rows,
                                exact_kl_rows, write_dump)
from parity.engines import HFEngine, Rollout, Sampling, Shard, stop_token_ids
from parity.scoring import score_full
from parity.errors import ParityError, one_line
from parity.loggers import MetricLoggers, check_backends
from parity.metrics import StepPart, json_safe, mean_dicts, step_metrics
from parity.objectives import (ValueHead, behaviour_weights, dpo_loss, dpo_pairs, gae,
                               grpo_advantages, gspo_loss, log_ratio, pg_is_loss, ppo_clip_loss,
                               value_loss, whiten)
from parity.precision import LossScaler, autocast, fp32_head
from parity.runs import check_run_dir, load_model_and_task, run_dir_for, truncate_metrics
from parity.tasks import PromptSampler, Task, build_task
from parity.ui import progress




def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr)


@dataclass
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
def prepare(cfg: Config, model: torch.nn.Module, value_head: ValueHead | None,
            ref_model: torch.nn.Module | None, r: Rollout, rewards: torch.Tensor, s: Sampling,
            device: torch.device, dist: Dist = Dist()) -> Prepared:
    mask = r.completion_mask
    p = Prepared(adv=grpo_advantages(rewards, cfg.samples_per_prompt, cfg.scale_rewards))
    if cfg.ratio_source == "recompute" or value_head is not None:
        with autocast(cfg.trainer_dtype, device, cfg.cpu_fp16):
            sc = score_full(model, r, s, hidden=value_head is not None)
        if cfg.ratio_source == "recompute":
            p.old = sc.logp
            p.weights, p.metrics = behaviour_weights(p.old, r.engine_logprobs, mask,
                                                     cfg.correction, cfg.is_cap, cfg.geo_cap)
            if cfg.correction == "none":
                p.weights = None
        if value_head is not None:
            p.old_values = value_head(sc.hidden) * mask
            adv, p.returns = gae(rewards, p.old_values, mask, cfg.gae_gamma, cfg.gae_lambda)
            p.adv = whiten(adv, mask, total=dist.sum)
            p.metrics["value/mean"] = float(p.old_values.sum() / mask.sum())
    if cfg.objective == "online-dpo":
        if cfg.dpo_ref == "engine":
            p.ref = r.engine_logprobs
        else:
            with autocast(cfg.trainer_dtype, device, cfg.cpu_fp16):
                p.ref = score_full(ref_model, r, s).logp
    return p


def objective_loss(cfg: Config, logp_pi: torch.Tensor, log_r: torch.Tensor, mb: Rollout,
                   p: Prepared, idx: slice, rewards: torch.Tensor, logp_s: torch.Tensor,
                   value_head: ValueHead | None, hidden: torch.Tensor | None,
                   dist: Dist = Dist()) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The configured objective on one minibatch: (loss, clipped mask, extra metrics). Across
    ranks each loss is this rank's share of the minibatch's global loss (`Dist.share`)."""
    mask, adv = mb.completion_mask, p.adv[idx]
    weights = p.weights[idx] if p.weights is not None else None
    no_clip = torch.zeros_like(mask, dtype=torch.bool)
    # What a loss is a mean over: ranks hold equal rows, but not equal tokens or pairs.
    n_tok = float(mask.sum())
    n_agg = n_tok if cfg.loss_agg == "token-mean" else float(mask.shape[0])
    if cfg.objective in ("ppo-clip", "ppo-value"):
        loss, clipped = ppo_clip_loss(log_r, adv, mask, cfg.eps_low, cfg.eps_high, cfg.loss_agg,
                                      cfg.max_new_tokens, weights)
        loss = dist.share(loss, n_agg)
        if value_head is None:
            return loss, clipped, {}
        v_loss = dist.share(value_loss(value_head(hidden), p.old_values[idx], p.returns[idx],
                                       mask, cfg.value_clip), n_tok)
        return loss + cfg.value_coef * v_loss, clipped, {"loss/value": float(v_loss.detach())}
    if cfg.objective == "gspo":
        loss, clipped = gspo_loss(log_r, adv, mask, cfg.seq_eps_low, cfg.seq_eps_high, weights)
        return loss, clipped, {}
    if cfg.objective == "pg-is":
        loss, stats = pg_is_loss(logp_pi, log_r, adv, mask, cfg.is_cap, cfg.loss_agg,
                                 cfg.max_new_tokens, weights)
        return dist.share(loss, n_agg), no_clip, stats
    chosen, rejected = dpo_pairs(rewards[idx], cfg.samples_per_prompt)
    loss, margins = dpo_loss(logp_pi, p.ref[idx], mask, chosen, rejected, cfg.dpo_scale)
    loss = dist.share(loss, float(len(chosen)))
    margins = margins.detach()
    extra = {"dpo/pairs": float(len(chosen))}
    if len(chosen):
        extra["dpo/margin"] = float(margins.mean())
        extra["dpo/accuracy"] = float((margins > 0).float().mean())
        if cfg.dpo_ref == "engine":
            # With ℓ_μ as the reference the margin carries Σβ(chosen) − Σβ(rejected).
            beta_seq = ((logp_pi.detach() - logp_s) * mask).sum(-1)
            mb_beta = cfg.dpo_scale * (beta_seq[chosen] - beta_seq[rejected])
            extra["dpo/margin_beta"] = float(mb_beta.mean())
            extra["dpo/margin_beta_abs"] = float(mb_beta.abs().mean())
    return loss, no_clip, extra


def _clip_range(cfg: Config) -> tuple[float | None, float | None]:
    if cfg.objective == "gspo":
        return cfg.seq_eps_low, cfg.seq_eps_high
    if cfg.objective in ("pg-is", "online-dpo"):
        return None, None
    return cfg.eps_low, cfg.eps_high









@dataclass
class Plan:
    """The prompts of one step and this rank's part of them."""
    rows: list[int]            # prompt rows of this rank's completions, one per completion
    sample_ids: list[int]      # their positions in the step's whole batch
    prompts: list[list[int]]
    record_rows: list[int]     # this rank's rows whose whole distribution is kept
    batch: int
    width: int                 # the longest prompt of the whole batch


def make_plan(cfg: Config, task: Task, prompts: PromptSampler, dist: Dist,
              kl_rows: list[int]) -> Plan:
    G = cfg.samples_per_prompt
    step_rows = prompts.next(cfg.prompts_per_step)
    mine = dist.shard(cfg.prompts_per_step, cfg.minibatches)
    sample_ids = [i * G + g for i in mine for g in range(G)]
    local = {sid: j for j, sid in enumerate(sample_ids)}
    return Plan([step_rows[i] for i in mine for _ in range(G)], sample_ids,
                [task.prompt_ids[step_rows[i]] for i in mine for _ in range(G)],
                [local[k] for k in kl_rows if k in local], cfg.prompts_per_step * G,
                max(len(task.prompt_ids[i]) for i in step_rows))


def train(cfg: Config, on_model: Callable[[torch.nn.Module], None] | None = None,
          resume: bool = False) -> Path:
    """Run RL as `cfg` says; returns the run directory. All input is checked before the run
    directory is touched. With `resume`, `cfg.out` is an earlier run: it continues from its
    newest valid checkpoint, exactly as if it had not stopped. `on_model` is called with the fp32
    master model before the engine and shadow copies are made (instrumentation, fault
    injection in tests). Under torchrun / accelerate launch every rank calls this; rank 0 alone
    writes the run directory."""
    dist = distributed.init(cfg.dist_timeout_s)
    try:
        return _train(cfg, dist, on_model, resume)
    except RuntimeError as e:
        if dist.on and is_comm_failure(e):
            raise RankFailure(failure_message(e)) from None
        raise
    finally:
        dist.close()


def _train(cfg: Config, dist: Dist, on_model: Callable[[torch.nn.Module], None] | None,
           resume: bool) -> Path:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.prompts_per_step % (cfg.minibatches * dist.world):
        raise ParityError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by "
                          f"minibatches x ranks = {cfg.minibatches} x {dist.world}: every rank "
                          f"takes whole prompt groups of every minibatch")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run = run_dir_for(cfg) if dist.main else Path()
    run = Path(dist.gather(str(run))[0])
    # Rank 0 checks the run directory and builds the testbed's caches; the others follow.
    error, restored, ctx = None, None, None
    if dist.main:
        try:
            restored = checkpoints.latest_valid(run) if resume else None
            if not resume:
                check_run_dir(run)
            backends = check_backends(cfg.report_to)  # a requested one not installed fails here
            if cfg.engine == "vllm":
                vllm_engine.check_available()
            ctx = load_model_and_task(cfg)
        except ParityError as e:
            error = str(e)
    dist.agree(error)
    restored = dist.gather(restored)[0]
    if ctx is None:
        ctx = load_model_and_task(cfg)
    model, tok, model_dir, task = ctx
    if dist.main and not resume:
        check_run_dir(run)
        run.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, run / "config.yaml")
        (run / "task.json").write_text(json.dumps({"task": task.name,
                                                   "model_dir": str(model_dir),
                                                   "rows": len(task.rows), **task.info},
                                                  indent=1))

    device = torch.device("cpu")
    s = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    if cfg.lm_head_fp32:
        fp32_head(model)
    if on_model is not None:
        on_model(model)
    if cfg.engine == "vllm":
        engine: HFEngine | vllm_engine.VLLMEngine = vllm_engine.VLLMEngine(
            model, str(model_dir), cfg.engine_dtype, stop_token_ids(model, tok),
            tok.pad_token_id, cfg.vllm_gpu_memory, cfg.seed)
    else:
        engine = HFEngine(model, cfg.engine_dtype, stop_token_ids(model, tok), tok.pad_token_id,
                          cfg.cpu_fp16, cfg.lm_head_fp32)
    model.train()
    value_head = ValueHead(model.config.hidden_size) if cfg.objective == "ppo-value" else None
    ref_model = (copy.deepcopy(model).eval().requires_grad_(False)
                 if cfg.objective == "online-dpo" and cfg.dpo_ref == "initial" else None)
    fsdp = dist.on and cfg.parallel == "fsdp"
    scaler = LossScaler(cfg.trainer_dtype, device, cfg.loss_scale_init,
                        cfg.loss_scale_growth_interval)
    prompts = PromptSampler(len(task.rows), cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    G = cfg.samples_per_prompt
    # The shadow ratio and DPO's engine reference need ℓ_s whether or not diagnostics are on.
    needs_shadow = cfg.ratio_source == "shadow" or (cfg.objective == "online-dpo"
                                                    and cfg.dpo_ref == "engine")
    shadow = (Shadow(model, cfg.engine_dtype, cfg.trainer_dtype, cfg.cpu_fp16, cfg.lm_head_fp32)
              if cfg.diagnostics or needs_shadow else None)
    eps_low, eps_high = _clip_range(cfg)
    kl_rows = exact_kl_rows(cfg.prompts_per_step * G, cfg.kl_exact_rows)
    first_step = 1
    if resume and restored is None and dist.main:
        truncate_metrics(run / "metrics.jsonl", 0)
    train_state = None
    if restored is not None:
        train_state = checkpoints.load_into(restored, model, engine.model, gen, value_head)
        scaler.load_state_dict(train_state["scaler"])
        prompts.load_state_dict(restored.state["prompts"])
        engine.version = restored.state["engine_version"]
        first_step = restored.step + 1
        if dist.main:
            truncate_metrics(run / "metrics.jsonl", restored.step)
            for stale in (run / "checkpoints").glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)  # a write the crash interrupted
    # Forward passes with gradient go through DDP (or the FSDP-sharded model itself), which
    # averages the gradients over ranks.
    if fsdp:
        dist.fully_shard(model)  # before the optimizer: its state lives on the shards
    policy, value = (model if fsdp else dist.wrap(model)), dist.wrap(value_head)
    params = [p for p in model.parameters() if p.requires_grad]
    params += list(value_head.parameters()) if value_head is not None else []
    opt = make_optimizer(cfg, params)
    if train_state is not None:
        state = train_state["optimizer"]
        if not fsdp:
            opt.load_state_dict(state)
        elif any(isinstance(k, int) for k in state.get("state", {})):
            raise ParityError(f"{restored.path} was written by a one-process run, whose "
                              f"optimizer state FSDP cannot load: resume it with one "
                              f"process, as it was started")
        else:
            set_optimizer_state_dict(model, opt, state,
                                     options=StateDictOptions(full_state_dict=True))

    aeng: AsyncEngine | None = None
    plans: dict[int, Plan] = {}
    prompt_states: dict[int, dict] = {first_step - 1: prompts.state_dict()}
    gen_after: dict[int, torch.Tensor] = {first_step - 1: gen.get_state()}

    def plan(step: int) -> Plan:
        plans[step] = make_plan(cfg, task, prompts, dist, kl_rows)
        prompt_states[step] = prompts.state_dict()
        return plans[step]

    next_request = first_step
    if cfg.async_engine:
        # The trainer keeps its threads and the engine adds one: on CPU the update is the
        # longer side, and halving its threads costs more than the overlap gains
        # (bench/async_step.py on 2 cores: 2+1 threads 0.89x the synchronous step, 1+1 1.28x).
        e_threads = cfg.engine_threads or 1
        a_state = restored.state.get("async") if restored is not None else None
        aeng = AsyncEngine(engine, s, cfg.max_new_tokens, cfg.max_staleness, cfg.sync_every,
                           e_threads, gen, first_step - 1, a_state,
                           checkpoints.engine_versions(restored) if a_state else None)

        def submit_ready() -> None:
            nonlocal next_request
            while next_request <= cfg.steps and \
                    (v := aeng.version_for(next_request)) is not None:
                p = plan(next_request)
                aeng.submit(Request(
                    next_request, v, p.prompts, p.record_rows,
                    Shard(p.sample_ids, p.batch, width=p.width, fixed_draws=dist.on)))
                next_request += 1

    def save(step: int) -> None:
        model_state = opt_state = None
        if fsdp:  # gathered by every rank, written by rank 0
            model_state = {k: full_tensor(v) for k, v in model.state_dict().items()}
            opt_state = get_optimizer_state_dict(model, opt, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        if not dist.main:
            return
        g = torch.Generator()
        g.set_state(gen_after[step])
        checkpoints.save(run, step, model, tok, engine.model, engine.version, opt,
                         scaler.state_dict(), prompt_states[step], g, value_head,
                         cfg.keep_checkpoints,
                         aeng.checkpoint_state() if aeng else None,
                         {v: w for v, w in aeng.pushed.items()} if aeng else None,
                         model_state, opt_state)

    with contextlib.ExitStack() as stack:
        if aeng is not None:
            stack.callback(aeng.close)
            submit_ready()
        if dist.main:
            # Line-buffered: every finished step is on disk, whatever happens to the next one.
            # The other backends are rewound to the same step on resume, and closed however
            # the run ends.
            metrics_file = stack.enter_context(open(run / "metrics.jsonl", "a", buffering=1))
            loggers = stack.enter_context(MetricLoggers(run, backends, cfg.to_dict(),
                                                        first_step - 1 if resume else None))
        bar = stack.enter_context(progress("train", cfg.steps, cfg.progress and dist.main,
                                           first_step - 1, eta=True))
        t_prev = time.perf_counter()
        for step in range(first_step, cfg.steps + 1):
            t0 = time.perf_counter()
            extra_m: dict[str, Any] = {}
            if aeng is None:
                changed = engine.sync(model)
                p = plan(step)
                r = engine.generate(p.prompts, cfg.max_new_tokens, s, gen, p.record_rows,
                                    Shard(p.sample_ids, p.batch, dist.all_true, p.width))
                gen_after[step] = gen.get_state()
            else:
                d = aeng.get(step)
                p, r = plans.pop(step), d.rollout
                changed = aeng.changed.get(d.version, 0.0)
                gen_after[step] = d.gen_state
                extra_m = {"async/staleness": step - 1 - d.version,
                           "async/engine_version": d.version,
                           "async/wait_s": time.perf_counter() - t0}
            if dist.on:
                r = r.pad_to(int(dist.max(r.completion_ids.shape[1])), tok.pad_token_id)
            comp_ids = r.completions()
            texts = tok.batch_decode(comp_ids, skip_special_tokens=True)
            total, parts = task.reward_parts(p.rows, texts, comp_ids)
            rewards = torch.tensor(total)
            prep = prepare(cfg, model, value_head, ref_model, r, rewards, s, device, dist)
            adv = prep.adv
            t1 = time.perf_counter()

            mb_size = len(p.rows) // cfg.minibatches
            losses, norms, diag, dump, update, extras = [], [], StepDiagnostics(), [], 0, []
            skipped_before = scaler.skipped
            dumping = cfg.dump_rollouts and step % cfg.dump_rollouts == 0
            sample_ids = torch.tensor(p.sample_ids)
            prompt_ids = torch.tensor(p.rows)
            for epoch in range(cfg.epochs):
                for start in range(0, len(p.rows), mb_size):
                    idx = slice(start, start + mb_size)
                    mb = r.select(idx)
                    with autocast(cfg.trainer_dtype, device, cfg.cpu_fp16):
                        sc = score_full(policy, mb, s, hidden=value_head is not None)
                    logp_pi, logits = sc.logp, sc.logits
                    # ℓ_s on the weights ℓ_π just saw, before this update moves them.
                    logp_s = (shadow.logprobs(model, mb, s, logp_pi) if shadow
                              else logp_pi.detach())
                    log_r = log_ratio(cfg.ratio_source, logp_pi, mb.engine_logprobs, logp_s,
                                      prep.old[idx] if prep.old is not None else None)
                    loss, clipped, extra = objective_loss(cfg, logp_pi, log_r, mb, prep, idx,
                                                          rewards, logp_s, value, sc.hidden,
                                                          dist)
                    extras.append(extra)
                    att = attribute(logp_pi, logp_s, mb.engine_logprobs, adv[idx],
                                    mb.completion_mask, eps_low, eps_high, clipped,
                                    sequence=cfg.objective == "gspo")
                    diag.add(att, logp_pi, mb.engine_logprobs, adv[idx], mb.completion_mask,
                             first=epoch == 0)
                    if epoch == 0 and r.dists is not None:
                        diag.add_exact_kl(exact_kl_of_rows(r, logits, mb.completion_mask, s, start))
                    if dumping:
                        dump.append(dump_table(step, update, epoch, sample_ids[idx],
                                               prompt_ids[idx], mb, adv[idx], logp_pi, logp_s,
                                               att, eps_low, eps_high))
                    del logits, sc
                    scaler.backward(loss)
                    _, norm = scaler.step(opt, params, cfg.max_grad_norm)
                    losses.append(float(loss.detach()))
                    norms.append(norm)
                    update += 1
            if aeng is not None:
                aeng.push(step, model)   # the weights after this step, if a sync step
                submit_ready()
            t2 = time.perf_counter()
            times = {"time/rollout_s": d.rollout_s if aeng else t1 - t0, "time/train_s": t2 - t1,
                     "time/step_s": t2 - (t_prev if aeng else t0)}
            t_prev = t2
            part = StepPart(total, parts, float(r.completion_mask.sum()),
                            int(r.finished.sum()), diag, prep.metrics, mean_dicts(extras),
                            sum(losses) / len(losses), times, dump)
            all_parts = dist.gather(part)
            for k in [k for k in prompt_states if k < step]:
                del prompt_states[k]
                gen_after.pop(k, None)
            if dist.main:  # rank 0 alone writes
                if dumping:
                    # update by update, each in rank order: the one-process row order
                    write_dump(run / "rollouts" / f"step-{step}.parquet",
                               [q.dump[u] for u in range(update) for q in all_parts])
                m: dict[str, Any] = {
                    "step": step,
                    **step_metrics(all_parts, cfg),
                    **extra_m,
                    "sync/changed_frac": changed,
                    "loss/scale": scaler.scale,
                    # over applied updates; null when the step's every update was skipped
                    "train/grad_norm": (sum(ok) / len(ok) if (ok := [n for n in norms
                                                                     if math.isfinite(n)])
                                        else None),
                    "train/skipped_updates": scaler.skipped,
                    "train/skipped_this_step": scaler.skipped - skipped_before,
                }
                if extra_m.get("async/staleness"):
                    # |α| at the first update is the kernel gap only where the engine had the
                    # trainer's weights; a stale rollout's α holds the updates it missed.
                    m.pop("mismatch/kernel_gap_abs_mean", None)
                metrics_file.write(json.dumps(json_safe(m)) + "\n")
                loggers.log(step, m)  # after the JSONL line: a failing backend cannot lose it
                bar.advance(1, f"reward {m['reward/mean']:+.3f}  len "
                               f"{m['completion/len_mean']:.1f}  clip {m['clip/frac']:.3f}")
            if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
                save(step)  # on every rank: FSDP gathers the shards first
    if first_step <= cfg.steps:  # else a finished run was "resumed": its final checkpoint stands
        save(cfg.steps)
    return run
