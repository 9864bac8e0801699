"""Where each step's rollout comes from: the engine in the trainer's process (synchronous: it
takes the newest weights before every rollout), or the asynchronous engine process, which samples
the next steps' rollouts from weights at most `max_staleness` steps old.

Either way a step's prompts are planned here, each rank sampling its shard, and the data-order
and sampling-RNG states after each step are kept until that step's checkpoint is written, so a
resumed run continues exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from parity import metric_names as mn
from parity.config import Config
from parity.engines import Engine, Shard
from parity.engines.async_process import AsyncEngine, Request
from parity.logprobs import Rollout, Sampling
from parity.runs.checkpoints import Restored, engine_versions
from parity.runs.distributed import Dist
from parity.tasks import PromptSampler, Task


@dataclass(kw_only=True)
class StepPlan:
    """The prompts of one step and this rank's part of them."""
    rows: list[int]            # prompt rows of this rank's completions, one per completion
    sample_ids: list[int]      # their positions in the step's whole batch
    prompts: list[list[int]]
    record_rows: list[int]     # this rank's rows whose whole distribution is kept
    batch: int
    width: int                 # the longest prompt of the whole batch


def make_plan(cfg: Config, task: Task, prompts: PromptSampler, dist: Dist,
              kl_rows: list[int]) -> StepPlan:
    G = cfg.samples_per_prompt
    step_rows = prompts.next(cfg.prompts_per_step)
    mine = dist.shard(cfg.prompts_per_step, cfg.minibatches)
    sample_ids = [i * G + g for i in mine for g in range(G)]
    local = {sid: j for j, sid in enumerate(sample_ids)}
    return StepPlan(rows=[step_rows[i] for i in mine for _ in range(G)], sample_ids=sample_ids,
                    prompts=[task.prompt_ids[step_rows[i]] for i in mine for _ in range(G)],
                    record_rows=[local[k] for k in kl_rows if k in local],
                    batch=cfg.prompts_per_step * G,
                    width=max(len(task.prompt_ids[i]) for i in step_rows))


@dataclass(kw_only=True)
class Delivery:
    """A step's rollout as the trainer receives it, from either source, with its plan."""
    plan: StepPlan
    rollout: Rollout
    changed: float                     # sync/changed_frac of the weights it was sampled with
    rollout_s: float | None = None     # the engine process's own sampling time (async)
    metrics: dict[str, Any] = field(default_factory=dict)   # async/*


class Rollouts:
    """Hands out step `step`'s rollout (`get`), takes the weights after each update
    (`after_update`), and keeps what a checkpoint of a step needs (`saved_states`)."""

    def __init__(self, cfg: Config, task: Task, engine: Engine, dist: Dist, s: Sampling,
                 prompts: PromptSampler, gen: torch.Generator, kl_rows: list[int],
                 first_step: int, restored: Restored | None):
        self.cfg, self.task, self.engine, self.dist, self.s = cfg, task, engine, dist, s
        self.prompts, self.gen, self.kl_rows = prompts, gen, kl_rows
        self.plans: dict[int, StepPlan] = {}
        self.prompt_states: dict[int, dict] = {first_step - 1: prompts.state_dict()}
        self.gen_after: dict[int, torch.Tensor] = {first_step - 1: gen.get_state()}
        self.aeng: AsyncEngine | None = None
        self.next_request = first_step
        if cfg.async_engine:
            # The trainer keeps its threads and the engine process adds one: on a CPU the
            # update is the longer side (docs/performance.md, asynchronous engine).
            a_state = restored.state.get("async") if restored is not None else None
            self.aeng = AsyncEngine(engine, s, cfg.max_new_tokens, cfg.max_staleness,
                                    cfg.sync_every, cfg.engine_threads or 1, gen, first_step - 1,
                                    a_state, engine_versions(restored) if a_state else None)
            self._submit_ready()

    def _plan(self, step: int) -> StepPlan:
        self.plans[step] = make_plan(self.cfg, self.task, self.prompts, self.dist, self.kl_rows)
        self.prompt_states[step] = self.prompts.state_dict()
        return self.plans[step]

    def _submit_ready(self) -> None:
        """Request every rollout whose weights the engine process already has."""
        while self.next_request <= self.cfg.steps and \
                (v := self.aeng.version_for(self.next_request)) is not None:
            plan = self._plan(self.next_request)
            self.aeng.submit(Request(
                step=self.next_request, version=v, prompts=plan.prompts,
                record_rows=plan.record_rows,
                shard=Shard(plan.sample_ids, plan.batch, width=plan.width,
                            fixed_draws=self.dist.on),
                max_batch=self.cfg.rollout_batch))
            self.next_request += 1

    def get(self, step: int, master: torch.nn.Module) -> Delivery:
        t0 = time.perf_counter()
        if self.aeng is None:
            changed = self.engine.sync(master)
            sync_s = time.perf_counter() - t0
            plan = self._plan(step)
            r = self.engine.generate(plan.prompts, self.cfg.max_new_tokens, self.s, self.gen,
                                     plan.record_rows, Shard(plan.sample_ids, plan.batch,
                                                             self.dist.all_true, plan.width),
                                     self.cfg.rollout_batch)
            self.gen_after[step] = self.gen.get_state()
            return Delivery(plan=plan, rollout=r, changed=changed,
                            metrics={mn.SYNC_S: sync_s})
        sampled = self.aeng.get(step)
        self.gen_after[step] = sampled.gen_state
        return Delivery(plan=self.plans.pop(step), rollout=sampled.rollout,
                        changed=self.aeng.changed.get(sampled.version, 0.0),
                        rollout_s=sampled.rollout_s,
                        metrics={mn.ASYNC_STALENESS: step - 1 - sampled.version,
                                 mn.ASYNC_ENGINE_VERSION: sampled.version,
                                 mn.ASYNC_WAIT_S: time.perf_counter() - t0})

    def after_update(self, step: int, master: torch.nn.Module) -> None:
        if self.aeng is not None:
            self.aeng.push(step, master)   # the weights after this step, if a sync step
            self._submit_ready()

    def forget_before(self, step: int) -> None:
        for k in [k for k in self.prompt_states if k < step]:
            del self.prompt_states[k]
            self.gen_after.pop(k, None)

    def saved_states(self, step: int) -> dict[str, Any]:
        """What checkpoints.save needs from here for a checkpoint of `step`."""
        g = torch.Generator()
        g.set_state(self.gen_after[step])
        return dict(prompts_state=self.prompt_states[step], gen=g,
                    async_state=self.aeng.checkpoint_state() if self.aeng else None,
                    engine_versions=dict(self.aeng.pushed) if self.aeng else None)

    def close(self) -> None:
        if self.aeng is not None:
            self.aeng.close()
        self.engine.close()
