"""The one typed config of a parity run, and recipes: named presets of it.

Precedence, lowest first: field defaults, the recipe's preset, the built-in task's defaults, a
YAML file (`--config`), command-line flags. Every field carries its documentation in
`metadata["help"]` and its checks: choices in its `Literal` type (or, for an objective or an
engine, in its registry: `metadata["choices"]`), bounds in `metadata["range"]`. The CLI builds
its flags from them and `check_fields` validates from them.
The settings of `parity audit` (AuditSettings, here so that building the CLI imports no torch)
and of the TRL integration reuse Config's fields (`shared`), so each is written once.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import numbers
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from parity.engines import ENGINES, SERVER_MIN_TEMPERATURE, EngineNeeds, refuse_unable
from parity.engines.abilities import refuse_temperature
from parity.errors import ParityError, one_line
from parity.files import read_text
from parity.objectives import OBJECTIVES

Dtype = Literal["fp32", "bf16", "fp16"]
RatioSource = Literal["engine", "shadow", "recompute"]
Correction = Literal["none", "token-tis", "token-mis", "seq-tis", "seq-mis", "geo-rs"]
LossAgg = Literal["seq-mean", "token-mean", "token-sum"]
DpoRef = Literal["initial", "engine"]
OptimizerName = Literal["adamw", "adam", "sgd"]
Parallel = Literal["ddp", "fsdp"]
CpuFp16 = Literal["emulate", "native"]
ServerEndpoint = Literal["auto", "completions", "chat"]
ShadowKernels = Literal["engine", "independent", "scored"]

DTYPES = typing.get_args(Dtype)
RATIO_SOURCES = typing.get_args(RatioSource)
CORRECTIONS = typing.get_args(Correction)
LOSS_AGGS = typing.get_args(LossAgg)
DPO_REFS = typing.get_args(DpoRef)
OPTIMIZERS = typing.get_args(OptimizerName)
PARALLEL = typing.get_args(Parallel)
# A device setting: `auto`, `cpu`, `cuda` or `cuda:N` (parity/devices.py resolves it).
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
# report_to is a comma-separated list of these, so no Literal can say it.
REPORT_TO = ("auto", "none", "tensorboard", "wandb")


def engine_needs(c: Any) -> EngineNeeds:
    """What the settings `c` (a Config, AuditSettings, or the TRL integration's) ask of the
    engine, for its registry entry to refuse what it cannot do (parity/engines/abilities.py)."""
    adapters = getattr(c, "lora_rank", 0) or getattr(c, "adapter", None)
    return EngineNeeds(lm_head_fp32=c.lm_head_fp32, lora_unmerged=bool(adapters)
                       and not c.lora_merge, scores=c.shadow_kernels == "scored",
                       temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                       min_p=getattr(c, "min_p", 0.0),
                       repetition_penalty=getattr(c, "repetition_penalty", 1.0))


@dataclass(frozen=True)
class Range:
    """Bounds of a number field; a float field must also be finite, bounded or not."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __contains__(self, v: float) -> bool:
        return not (self._below(v) or self._above(v))

    def _below(self, v: float) -> bool:
        return ((self.ge is not None and not v >= self.ge)
                or (self.gt is not None and not v > self.gt))

    def _above(self, v: float) -> bool:
        return ((self.le is not None and not v <= self.le)
                or (self.lt is not None and not v < self.lt))

    def complaint(self, v: float, is_float: bool) -> str | None:
        """What `v` must be, naming the bound it breaks (both for a non-finite float); None when
        it is in range."""
        finite = not is_float or math.isfinite(v)
        if finite and v in self:
            return None
        low = [f"{op} {b:g}" for op, b in ((">=", self.ge), (">", self.gt)) if b is not None]
        high = [f"{op} {b:g}" for op, b in (("<=", self.le), ("<", self.lt)) if b is not None]
        if finite and self._above(v) and not self._below(v):
            return " and ".join(high)
        text = " and ".join(low if finite else low + high)
        return f"a finite number {text}".rstrip() if is_float else text


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A field with its help and checks: `ge`/`gt`/`le`/`lt` bound a number; other keywords
    (`const`, `metavar`) are kept in the metadata for the CLI."""
    bounds = {k: kw.pop(k) for k in ("ge", "gt", "le", "lt") if k in kw}
    meta = {"help": help, **kw, "range": Range(**bounds)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class Config:
    # -- what to train
    recipe: str = _f("bf16-engine", "Named preset of precision, ratio source, clip and correction "
                     "(`parity recipes` lists them); explicit fields override it.")
    task: str = _f("neg-length", "Task: `neg-length`, `neg-length-chat` (short chat questions, "
                   "for instruct models), `arith`, or a dataset file (JSONL/parquet "
                   "with a `prompt` column) used with `--reward`.")
    reward: str | None = _f(None, "Reward function `module:function` or `path/file.py:function` "
                            "with TRL's signature reward(prompts, completions, **columns) -> "
                            "list[float]; several, comma-separated, are summed with "
                            "`reward_weights`. Required for a dataset task, optional otherwise.")
    reward_weights: str | None = _f(None, "Comma-separated weight of each reward function, in "
                                    "`reward`'s order (None: every weight 1), as TRL's "
                                    "reward_weights.")
    chat_template: bool = _f(False, "Wrap plain-text prompts as a user message in the "
                             "tokenizer's chat template. Conversational prompts (a list of "
                             "{role, content} messages) always use it.")
    model: str | None = _f(None, "Testbed model name (`parity testbed list`) or a local Hugging "
                           "Face causal LM directory. None: the built-in task's testbed model "
                           "(a dataset task must name one).")
    # -- precision (the subject of parity)
    engine: str = _f("hf", "Rollout engine: " + "; ".join(
        f"`{e.name}` ({e.summary})" for e in ENGINES.values()) + ".", choices=ENGINES)
    engine_dtype: Dtype = _f("bf16", "Precision of the engine's copy of the weights: "
                             "fp32|bf16|fp16.")
    trainer_dtype: Dtype = _f("fp32", "Trainer compute precision: fp32, or bf16/fp16 autocast "
                              "over fp32 master weights.")
    ratio_source: RatioSource = _f("engine", "Denominator of the PPO ratio: `engine` (log r = "
                                   "l_pi - l_mu, beta inside the clip), `shadow` (value l_s - "
                                   "l_mu from the engine-precision shadow forward, gradient "
                                   "through l_pi), `recompute` (l_pi - l_old, l_old recomputed by "
                                   "the trainer before the first update).")
    correction: Correction = _f("none", "Behaviour weights w = exp(l_old - l_mu) with "
                                "`recompute`: none, token-tis|token-mis (per token, truncate|mask "
                                "at is_cap), seq-tis|seq-mis (per sequence), geo-rs (reject "
                                "sequences whose geometric-mean weight is beyond geo_cap).")
    is_cap: float = _f(2.0, "C of TIS/MIS: weights above it are truncated or masked; also the "
                       "truncation of pg-is's sequence weight.", ge=1)
    geo_cap: float = _f(1.01, "geo-rs: reject a sequence when exp(|mean_t log w|) exceeds this.",
                        ge=1)
    eps_low: float | None = _f(0.2, "Lower clip range: ratios below 1 - eps_low are clipped for "
                               "A < 0. None disables clipping.", ge=0, lt=1)
    eps_high: float | None = _f(0.2, "Upper clip range: ratios above 1 + eps_high are clipped for "
                                "A > 0. None disables clipping.", ge=0)
    seq_eps_low: float | None = _f(3e-4, "GSPO's own lower clip range on the sequence's "
                                   "geometric-mean ratio (None: no clip).", ge=0, lt=1)
    seq_eps_high: float | None = _f(4e-4, "GSPO's own upper clip range (None: no clip).", ge=0)
    # -- LoRA (parity/lora.py; docs/lora.md)
    lora_rank: int = _f(0, "Train LoRA adapters of this rank on a frozen base (peft); 0: train "
                        "every weight.", ge=0)
    lora_alpha: float | None = _f(None, "LoRA's alpha: the adapters' product is scaled by "
                                  "alpha / rank (None: twice the rank).", gt=0)
    lora_targets: str = _f("all-linear", "Modules that get adapters: comma-separated names "
                           "(q_proj,v_proj), or `all-linear`: every linear layer but the output "
                           "head, the attention and MLP projections.")
    lora_merge: bool = _f(True, "How the engine and the shadow apply the adapters: merged (W + "
                          "(alpha/r) B A summed in fp32, cast once, as TRL loads vLLM) or, with "
                          "--no-lora-merge, unmerged (base and adapters cast apart, applied as "
                          "their own products, as vLLM serves a LoRA request).")
    base_dtype: Dtype = _f("fp32", "LoRA: the frozen base's dtype in the trainer (bf16 halves its "
                           "memory and computes the base in bf16); the adapters stay fp32.")
    keep_dropout: bool = _f(False, "Keep the model's dropout in the trainer's forwards (l_pi, "
                            "l_old). Off by default: dropout noise would be reported as precision "
                            "gap beta (docs/design.md).")
    lm_head_fp32: bool = _f(False, "Compute the LM head in fp32 on both sides (engine and "
                            "trainer), whatever the dtype of the rest.")
    shadow_kernels: ShadowKernels = _f("engine", "The shadow forward's arithmetic: `engine` "
                                       "(the engine's attention implementation, so its kernel "
                                       "gap is batch-shape noise alone) or `independent` (the "
                                       "trainer's own attention, as a trainer computing against "
                                       "a separate inference engine such as vLLM must) or "
                                       "`scored` (the engine scores the shadow itself on the "
                                       "current weights: a weight load and a scoring pass per "
                                       "update; against vLLM 0 to 1e-3, at T = 1 without "
                                       "top-p/top-k only, docs/vllm.md); the gap "
                                       "left is mismatch/kernel_gap_abs_mean.")
    cpu_fp16: CpuFp16 = _f("emulate", "How fp16 matrix products run on CPU: `emulate` (fp16 "
                           "inputs, float64 accumulation, fp16 output: GPU tensor cores' numerics "
                           "to an ulp, the same for any batch shape; fast) or "
                           "`native` (torch's CPU fp16 kernels; several times slower: "
                           "docs/performance.md).")
    loss_scale_init: float = _f(2.0**16, "fp16 only: initial dynamic loss scale.", gt=0)
    loss_scale_growth_interval: int = _f(400, "fp16 only: overflow-free updates before the loss "
                                         "scale doubles.", gt=0)
    # -- objective
    objective: str = _f("ppo-clip", "Policy objective: " + "; ".join(
        f"`{o.name}` ({o.summary})" for o in OBJECTIVES.values()) + ".", choices=OBJECTIVES)
    loss_agg: LossAgg = _f("seq-mean", "Loss aggregation of token objectives: `seq-mean` (GRPO), "
                           "`token-mean` (DAPO: every token of the minibatch weighs the same), "
                           "`token-sum` (Dr.GRPO: token sum over minibatch size x "
                           "max_new_tokens).")
    value_coef: float = _f(0.1, "ppo-value: weight of the value loss.", ge=0)
    value_clip: float | None = _f(0.2, "ppo-value: clip of the value update (None: no clip).",
                                  gt=0)
    gae_gamma: float = _f(1.0, "ppo-value: GAE discount.", ge=0, le=1)
    gae_lambda: float = _f(0.95, "ppo-value: GAE lambda.", ge=0, le=1)
    dpo_scale: float = _f(0.1, "online-dpo: DPO's temperature (DPO papers call it beta; here "
                          "beta is the precision gap).", gt=0)
    dpo_ref: DpoRef = _f("initial", "online-dpo reference: `initial` (the starting policy, "
                         "frozen) or `engine` (the engine's log-probs l_mu, so the precision gap "
                         "enters the margin: reported as dpo/margin_beta).")
    scale_rewards: bool = _f(True, "Divide group-centred rewards by the group's std (GRPO); "
                             "False keeps only the centring (Dr.GRPO).")
    # -- optimisation
    optimizer: OptimizerName = _f("adamw", "Optimizer over the fp32 master weights: "
                                  "adamw|adam|sgd.")
    lr: float = _f(1e-5, "Learning rate (built-in tasks set their own default).", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (<= 0 disables).")
    steps: int = _f(100, "RL steps, each a rollout and its updates (built-in tasks set their "
                    "own default).", gt=0)
    prompts_per_step: int = _f(8, "Distinct prompts sampled per step.", gt=0)
    samples_per_prompt: int = _f(8, "Completions per prompt (the GRPO group size).", gt=0)
    minibatches: int = _f(1, "Optimizer steps per epoch: the step's completions split this many "
                          "ways (by whole groups).", gt=0)
    epochs: int = _f(1, "Passes over the step's completions.", gt=0)
    # -- memory: trade time for memory without changing the algorithm (docs/performance.md)
    micro_batch: int = _f(0, "Completions per forward and backward inside one optimizer step "
                          "(gradient accumulation: the same update as one forward over the "
                          "minibatch, to float rounding); 0: the whole minibatch at once.",
                          ge=0)
    micro_batch_tokens: int = _f(0, "Token budget per forward (prompt + completion positions, "
                                 "padding included): consecutive completions packed up to it, "
                                 "as verl's dynamic batch size; 0: no budget. With micro_batch, "
                                 "both limits hold.", ge=0)
    logprob_chunk: int = _f(0, "Positions whose vocabulary-wide logits exist at once when "
                            "scoring (the rest are recomputed in the backward); 0: every "
                            "position of a forward at once.", ge=0)
    rollout_batch: int = _f(0, "Prompts the hf engine decodes at once (its KV cache and logits "
                            "grow with it): a larger step is sampled in pieces of this many, "
                            "with the same completions; 0: all of the step's at once.", ge=0)
    gradient_checkpointing: bool = _f(False, "Recompute each layer's activations in the "
                                      "backward instead of keeping them (transformers' "
                                      "gradient checkpointing): about a third more update "
                                      "time for a fraction of the activation memory.")
    # -- sampling
    max_new_tokens: int = _f(64, "Max completion tokens, EOS included (built-in tasks set "
                             "their own default).", gt=0)
    temperature: float = _f(1.0, "Sampling temperature; the trainer scores with the same one.",
                            gt=0)
    top_p: float = _f(1.0, "Nucleus sampling mass (1.0 disables).", gt=0, le=1)
    top_k: int = _f(0, "Keep the k most likely tokens (0 disables).", ge=0)
    # -- diagnostics (parity/diagnostics.py)
    diagnostics: bool = _f(True, "Shadow forward on every update (one no-grad forward in engine "
                           "precision): alpha/beta per token and every clip attributed to "
                           "policy change or numerics. Off: clip/frac and the KL estimates only.")
    kl_exact_rows: int = _f(4, "Completions per step whose whole engine distribution is kept for "
                            "the exact KL(mu||pi) (rows x length x vocab floats; 0: off).", ge=0)
    dump_rollouts: int = _f(0, "Write rollouts/step-N.parquet (one row per token per update) "
                            "every N steps; `--dump-rollouts` alone means every step; 0: off.",
                            const=1, ge=0)
    # -- scale (docs/scaling.md)
    async_engine: bool = _f(False, "Run the engine in its own process: it samples the next "
                            "steps' rollouts while the trainer learns, from weights at most "
                            "`max_staleness` optimizer steps old (alpha then carries the "
                            "staleness; `async/staleness` reports it per step).")
    max_staleness: int = _f(1, "Async: a rollout is sampled from the weights of exactly this many "
                            "steps ago, once there are that many (fewer right after the start "
                            "or a sync_every gap); 0 waits for the newest weights, as the "
                            "synchronous loop does.", ge=0)
    # No declared range: its bound depends on max_staleness, so validate() checks it.
    sync_every: int = _f(1, "Async: push the trainer's weights to the engine every N steps "
                         "(1 <= N <= max_staleness + 1, so no rollout is staler than "
                         "max_staleness).")
    engine_threads: int = _f(0, "Async: torch threads of the engine process (0: one). The "
                             "trainer keeps `threads`: split the cores with both when sampling "
                             "is the longer side.", ge=0)
    vllm_gpu_memory: float = _f(0.3, "engine=vllm on a GPU: share of the GPU's memory vLLM may "
                                "take (its KV cache is sized to the batch on every device).",
                                gt=0, le=1)
    parallel: Parallel = _f("ddp", "Multi-process runs (torchrun / accelerate launch): `ddp` "
                            "(every rank holds the model) or `fsdp` (parameters, gradients and "
                            "optimizer state sharded with FSDP2's fully_shard).")
    dist_timeout_s: float = _f(600.0, "Multi-process: seconds a rank waits for the others in a "
                               "collective before the run stops with an error.", gt=0)
    # -- bookkeeping
    # torch seeds its generators with an unsigned 64-bit integer.
    seed: int = _f(0, "Seed for data order, sampling and initialisation of anything random.",
                   ge=0, lt=2**63)
    out: str | None = _f(None, "Run directory. None: runs/<task>-<recipe>-s<seed>.")
    save_every: int = _f(100, "Save a checkpoint every N steps (0: only at the end); "
                         "`parity train --resume RUN` continues from the newest.", ge=0)
    keep_checkpoints: int = _f(3, "Keep the newest K checkpoints (0: all).", ge=0)
    device: str = _f("auto", "Where the trainer, engine, shadow and reference compute: `auto` "
                     "(the rank's CUDA device when torch sees one, else the CPU), `cpu`, `cuda`, "
                     "`cuda:N`.", pattern=DEVICE_PATTERN,
                     pattern_text="auto, cpu, cuda or cuda:N", metavar="DEVICE")
    threads: int = _f(0, "torch CPU threads (0: torch's default).", ge=0)
    progress: bool = _f(True, "Show a progress bar.")
    report_to: str = _f("auto", "Metric backends besides metrics.jsonl (always written), "
                        "comma-separated: `tensorboard`, `wandb` (offline mode); `auto`: each one "
                        "that is installed; `none`.")

    def validate(self) -> "Config":
        """Refuse bad settings before any work starts, with one line naming the field: every
        field's own checks (`check_fields`), then the rules that tie fields together."""
        if self.recipe not in RECIPES:
            raise ParityError(f"unknown recipe {quoted(self.recipe)}; known recipes: "
                              f"{', '.join(RECIPES)}")
        check_fields(self)
        objective = OBJECTIVES[self.objective]
        self._check_scale(objective.value_head)
        self._check_lora()
        self._check_engine()
        self._check_groups(objective.pairs, objective.value_head)
        if self.model is None:
            raise ParityError(f"task {quoted(self.task)} has no default model: give --model "
                              f"NAME|DIR")
        self._check_batches(objective.pairs)
        self.reward_weight_list()
        for name in self.report_to.split(","):
            if name.strip() not in REPORT_TO:
                raise ParityError(f"report_to: {quoted(name.strip())} is not one of: "
                                  f"{', '.join(REPORT_TO)}")
        return self

    def _check_scale(self, value_head: bool) -> None:
        """The asynchronous engine's and FSDP's rules."""
        if not 1 <= self.sync_every <= self.max_staleness + 1:
            raise ParityError(f"sync_every={self.sync_every} must be in [1, max_staleness + 1 = "
                              f"{self.max_staleness + 1}]: rarer pushes would leave rollouts "
                              f"staler than max_staleness")
        if self.sync_every != 1 and not self.async_engine:
            raise ParityError(f"sync_every={self.sync_every} applies to the asynchronous engine: "
                              f"add --async-engine")
        if self.parallel == "fsdp" and value_head:
            raise ParityError(f"objective={self.objective} keeps its value head outside the "
                              f"FSDP-sharded model: use parallel=ddp")

    def _check_lora(self) -> None:
        """LoRA's settings apply with a rank, and a LoRA run with what supports it."""
        if self.lora_rank and (self.async_engine or self.parallel == "fsdp"):
            what = "--async-engine" if self.async_engine else "--parallel fsdp"
            raise ParityError(f"lora_rank={self.lora_rank}: LoRA runs do not support {what} yet "
                              f"(docs/lora.md); use the in-process hf engine with ddp")
        if not self.lora_rank and (self.lora_alpha is not None
                                   or self.lora_targets != "all-linear"):
            which = "lora_alpha" if self.lora_alpha is not None else "lora_targets"
            raise ParityError(f"{which}={quoted(getattr(self, which))} applies to LoRA adapters: "
                              f"add --lora-rank R (without it every weight is trained)")
        if self.base_dtype != "fp32" and not self.lora_rank:
            raise ParityError(f"base_dtype={self.base_dtype} applies to LoRA's frozen base: add "
                              f"--lora-rank R (a full fine-tune keeps fp32 master weights)")
        if self.base_dtype == "fp16":
            raise ParityError("base_dtype=fp16: the base is held in fp32 or bf16")

    def _check_engine(self) -> None:
        """What the engine, the shadow and the ratio's denominator can do together."""
        if self.shadow_kernels == "scored" and self.async_engine:
            raise ParityError("shadow_kernels=scored scores on the engine in the trainer's "
                              "process: the asynchronous engine lives in another one")
        refuse_unable(self.engine, engine_needs(self))
        if self.correction != "none" and self.ratio_source != "recompute":
            raise ParityError(f"correction={self.correction!r} reweights by exp(l_old - l_mu) and "
                              f"needs ratio_source=recompute (it is {self.ratio_source!r}); "
                              f"the `tis` and `seq-mis` recipes set both")

    def _check_groups(self, pairs: bool, value_head: bool) -> None:
        """A group holds what the objective's advantages or pairs need."""
        if self.samples_per_prompt < 2 and pairs:
            raise ParityError(f"objective={self.objective} pairs completions of one prompt: "
                              f"samples_per_prompt must be >= 2")
        if self.samples_per_prompt < 2 and not value_head:
            # A_i = (R_i - mean) / (std + eps) over a group of one: 0, or NaN with the std.
            raise ParityError(f"samples_per_prompt={self.samples_per_prompt}: the group-relative "
                              f"advantage of objective={self.objective} is always 0 for a group "
                              f"of one completion (NaN with scale_rewards); samples_per_prompt "
                              f"must be >= 2")

    def _check_batches(self, pairs: bool) -> None:
        """Micro-batches and minibatches hold whole groups where the objective needs them."""
        if pairs and self.micro_batch % self.samples_per_prompt:
            raise ParityError(f"micro_batch={self.micro_batch}: objective={self.objective} pairs "
                              f"completions of one prompt, so a micro-batch holds whole groups: "
                              f"a multiple of samples_per_prompt={self.samples_per_prompt}")
        if self.prompts_per_step % self.minibatches:
            raise ParityError(f"prompts_per_step={self.prompts_per_step} must be divisible by "
                              f"minibatches={self.minibatches} (minibatches hold whole groups)")

    def reward_specs(self) -> list[str]:
        return [x.strip() for x in self.reward.split(",")] if self.reward else []

    def reward_weight_list(self) -> list[float]:
        """One weight per reward function; a mismatch or a bad number is refused."""
        specs = self.reward_specs()
        if self.reward_weights is None:
            return [1.0] * len(specs)
        try:
            w = [float(x) for x in self.reward_weights.split(",")]
        except ValueError:
            raise ParityError(f"reward_weights={quoted(self.reward_weights)} must be "
                              f"comma-separated numbers") from None
        if len(w) != len(specs):
            raise ParityError(f"reward_weights has {len(w)} values for {len(specs)} reward "
                              f"functions (reward={quoted(self.reward)})")
        if not all(math.isfinite(x) for x in w):
            raise ParityError(f"reward_weights={quoted(self.reward_weights)} must be finite")
        return w

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    settings: dict[str, Any]


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# What every recipe sets.
RECIPE_FIELDS = ("engine_dtype", "trainer_dtype", "ratio_source", "eps_low", "eps_high",
                 "seq_eps_low", "seq_eps_high", "correction")


def _mismatch(**kw: Any) -> dict[str, Any]:
    """bf16 engine against an fp32 trainer, as Config's defaults have it (bf16-engine is the
    default recipe), with the fix's own settings on top."""
    return {**{k: FIELDS[k].default for k in RECIPE_FIELDS}, **kw}


# docs/design.md's table: the mismatch, the fixes, and the references.
RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16-engine", "The mismatch: bf16 engine, fp32 trainer, engine log-probs in the ratio.",
           _mismatch()),
    Recipe("bf16-shadow", "Beta out of the ratio: its value comes from a bf16 shadow forward on "
           "the trainer's weights, its gradient from the fp32 forward.",
           _mismatch(ratio_source="shadow")),
    Recipe("wide-eps", "The mismatch with a wider clip range (DAPO's clip-higher 0.28; GSPO's "
           "doubled); set eps_high/eps_low to taste.",
           _mismatch(eps_high=0.28, seq_eps_high=2 * FIELDS["seq_eps_high"].default)),
    Recipe("no-clip", "The mismatch without clipping (token and sequence).",
           _mismatch(eps_low=None, eps_high=None, seq_eps_low=None, seq_eps_high=None)),
    Recipe("recompute", "Decoupled PPO: old log-probs recomputed by the fp32 trainer, beta "
           "leaves the ratio (and no behaviour weight).",
           _mismatch(ratio_source="recompute")),
    Recipe("tis", "recompute, times the token weight exp(l_old - l_mu) truncated at is_cap "
           "(truncated importance sampling).",
           _mismatch(ratio_source="recompute", correction="token-tis")),
    Recipe("seq-mis", "recompute, times the sequence weight, sequences beyond is_cap masked "
           "(masked importance sampling).",
           _mismatch(ratio_source="recompute", correction="seq-mis")),
    Recipe("fp16", "The FP16 paper: fp16 engine, fp16 autocast trainer over fp32 master weights "
           "with dynamic loss scaling.",
           _mismatch(engine_dtype="fp16", trainer_dtype="fp16")),
    Recipe("bf16", "bf16 on both sides: bf16 engine, bf16 autocast trainer.",
           _mismatch(trainer_dtype="bf16")),
    Recipe("fp32", "The reference: fp32 engine and fp32 trainer.",
           _mismatch(engine_dtype="fp32")),
]}

# The built-in tasks' own defaults, applied over the recipe and under YAML and flag values. The
# model names are testbed models (parity/testbed.py SPECS) or built-in pretrained ones
# (parity/pretrained.py); the chat task's lr is TRL's GRPOConfig default.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "neg-length": dict(model="text", lr=3e-4, steps=30, max_new_tokens=24),
    "neg-length-chat": dict(model="smollm2-135m", lr=1e-6, steps=20, max_new_tokens=64),
    "arith": dict(model="arith", lr=3e-4, steps=800, prompts_per_step=16, max_new_tokens=8),
}


@dataclass(frozen=True)
class FieldSpec:
    """What the checks and the CLI need of one field of a settings dataclass, its annotation
    resolved (the modules use `from __future__ import annotations`: annotations are strings)."""
    field: dataclasses.Field
    kind: type                          # bool, int, float or str
    optional: bool                      # None allowed
    literal: tuple[str, ...] | None     # the values of a Literal

    @property
    def range(self) -> Range:
        return self.field.metadata.get("range", Range())

    @property
    def choices(self) -> tuple[str, ...] | None:
        """A Literal's values, or the names in the registry the field's `choices` metadata
        holds (read when asked: an entry registered later is a choice too)."""
        registry = self.field.metadata.get("choices")
        return tuple(registry) if registry is not None else self.literal


@functools.cache
def field_specs(cls: type) -> dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        hint, args = hints[f.name], typing.get_args(hints[f.name])
        optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        literal = typing.get_origin(hint) is Literal
        specs[f.name] = FieldSpec(f, str if literal else hint, optional,
                                  typing.get_args(hint) if literal else None)
    return specs


def check_fields(obj: Any) -> None:
    """Refuse a field value outside its type, its Literal's choices or its range, with one line
    naming the field. Floats must be finite: NaN and inf pass no comparison a run relies on."""
    for name in field_specs(type(obj)):
        check_value(type(obj), name, getattr(obj, name))


def check_value(cls: type, name: str, v: Any) -> None:
    """`check_fields` for one value of field `name` of `cls`."""
    sp = field_specs(cls)[name]
    if v is None:
        if not sp.optional:
            raise ParityError(f"{name} cannot be empty")
    elif sp.choices is not None:
        if v not in sp.choices:
            raise ParityError(f"{name}={quoted(v)} is not one of: {', '.join(sp.choices)}")
    elif sp.kind in (int, float):
        want = numbers.Integral if sp.kind is int else numbers.Real
        if isinstance(v, bool) or not isinstance(v, want):
            raise ParityError(f"{name}={quoted(v)} is not a valid {sp.kind.__name__}")
        must = sp.range.complaint(v, sp.kind is float)
        if must is not None:
            null = " (or null)" if sp.optional else ""
            raise ParityError(f"{name}={quoted(v)} must be {must}{null}")
    elif (pattern := sp.field.metadata.get("pattern")) and not re.fullmatch(pattern, str(v)):
        raise ParityError(f"{name}={quoted(v)} must be {sp.field.metadata['pattern_text']}")


def coerce(name: str, value: Any, cls: type | None = None) -> Any:
    """Convert a YAML or flag value to the type of field `name` of `cls` (Config by default), or
    raise ParityError naming the field. Choices and ranges are `check_fields`'s."""
    specs = field_specs(cls or Config)
    if name not in specs:
        raise ParityError(f"unknown config field {quoted(name)}")
    sp = specs[name]
    if not isinstance(value, (str, numbers.Real, datetime.date, type(None))):
        # Every field holds one value; str() of a YAML list or mapping would pass it as text.
        what = {list: "list", dict: "mapping", set: "set", bytes: "binary value"}.get(
            type(value), type(value).__name__)
        raise ParityError(f"{name} must be one {sp.kind.__name__} value, not a YAML {what}")
    if value is None or (sp.optional and isinstance(value, str)
                         and value.lower() in ("none", "null")):
        if sp.optional:
            return None
        raise ParityError(f"{name} cannot be empty")
    try:
        if sp.kind is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if sp.kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError(value)
            return int(float(value))
        if sp.kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):  # int(float("inf")) overflows
        raise ParityError(f"{name}={quoted(value)} is not a valid {sp.kind.__name__}") from None


def shared(name: str, *, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
    """Config's field `name`, for settings that repeat it (the audit's, the TRL integrations'):
    its default, help and checks come from Config, its type is declared beside it (and
    tests/test_settings.py holds it to Config's). `default` and `help` replace Config's only
    where the field means something else there."""
    f = FIELDS[name]
    meta = {**f.metadata, **({"help": help} if help is not None else {})}
    return field(default=f.default if default is dataclasses.MISSING else default, metadata=meta)


def own(default: Any, help: str, **checks: Any) -> Any:
    """A field of such settings that Config does not have, checked as Config's are (`_f`)."""
    return _f(default, help, **checks)


# The fields an audit shares with a run are Config's, so their defaults, help and checks are
# written once. A help differs where the audit uses the field differently (built-in tasks set no
# max_new_tokens here; kl_exact_rows counts per batch), and `task` defaults to None because it is
# one of three inputs.
@dataclass(kw_only=True)
class AuditSettings:
    """What `parity audit` measures, on which input, and how it samples."""
    model: str | None = shared("model")
    engine: str = shared("engine")
    engine_dtype: Dtype = shared("engine_dtype")
    trainer_dtype: Dtype = shared("trainer_dtype")
    task: str | None = shared(
        "task", default=None,
        help=f"Sample prompts of a task: `neg-length`, `neg-length-chat`, `arith`, or a dataset "
             f"file (JSONL/parquet with a `prompt` column) with `--reward` (default: "
             f"{FIELDS['task'].default}).")
    prompts: str | None = own(None, "Sample these prompts: a .txt file, one per line, or "
                              "JSONL/parquet with a `prompt` column.", metavar="FILE")
    rollouts: str | None = own(None, "Audit completions and engine log-probs another system "
                               "wrote (JSONL/parquet: prompt_token_ids, completion_token_ids, "
                               "engine_logprobs[, advantage|reward]).", metavar="FILE")
    server: str | None = own(None, "Sample the prompts (--task or --prompts) from a running "
                             "OpenAI-compatible server (vLLM) at this address, http://HOST:PORT, "
                             "instead of parity's engine; its answers are kept as "
                             "OUT/rollouts.jsonl and audited as --rollouts audits a file "
                             "(docs/serving.md).", metavar="URL")
    server_model: str | None = own(None, "With --server: the served model to ask, an id of its "
                                   "/v1/models (default: the only one it serves).",
                                   metavar="NAME")
    server_endpoint: ServerEndpoint = own(
        "auto", "With --server: `completions` sends the prompt's token ids to /v1/completions, "
        "`chat` the messages to /v1/chat/completions (the server's chat template); `auto`: chat "
        "for conversations or --chat-template.")
    server_timeout_s: float = own(120.0, "With --server: seconds to wait for each answer (one "
                                  "request asks for --group completions of a prompt) before "
                                  "stopping with an error.", gt=0)
    reward: str | None = shared("reward")
    chat_template: bool = shared("chat_template")
    samples: int = own(256, "Completions to sample.", gt=0)
    group: int = own(8, "Completions per prompt (the GRPO group of the advantages).", gt=0)
    max_new_tokens: int = shared("max_new_tokens", help="Max completion tokens, EOS included.")
    temperature: float = shared("temperature")
    top_p: float = shared("top_p")
    top_k: int = shared("top_k")
    # The recipes' clip range, so that the headline is the share a run's clip would see.
    eps: float = own(FIELDS["eps_low"].default, "Clip range of the headline fractions (a sweep "
                     "over eps is always added).", gt=0, lt=1)
    batch_size: int = own(64, "Completions per trainer forward.", gt=0)
    logprob_chunk: int = shared("logprob_chunk")
    kl_exact_rows: int = shared("kl_exact_rows", help="Completions per batch whose whole engine "
                                "distribution is kept for the exact KL(mu||pi) over the "
                                "vocabulary (0 disables).")
    cpu_fp16: CpuFp16 = shared("cpu_fp16")
    lm_head_fp32: bool = shared("lm_head_fp32")
    shadow_kernels: ShadowKernels = shared("shadow_kernels")
    fp16_check: str | None = own(None, "A `parity fp16-check` result (its fp16_check.json or "
                                 "output directory) for this model: the advice then says whether "
                                 "the fp16 recipe fits (docs/diagnostics.md, What to do).",
                                 metavar="FILE")
    adapter: str | None = own(None, "A LoRA adapter directory (peft's save_pretrained, or a LoRA "
                              "run's checkpoint) to apply to --model.", metavar="DIR")
    lora_merge: bool = shared("lora_merge")
    seed: int = shared("seed")
    device: str = shared("device")
    threads: int = shared("threads")
    progress: bool = shared("progress")

    def validate(self) -> AuditSettings:
        """Refuse bad settings before any work, one line naming the field, as `parity train`
        does: each field's own checks (Config's for the shared ones), then the input."""
        check_fields(self)
        if self.server:
            refuse_temperature(self.temperature, SERVER_MIN_TEMPERATURE, "a vLLM server")
        refuse_unable(self.engine, engine_needs(self))
        if len([x for x in (self.task, self.prompts, self.rollouts) if x]) != 1:
            raise ParityError("audit: give exactly one of --task, --prompts, --rollouts")
        if self.model is None:
            raise ParityError("audit: give --model NAME|DIR")
        if self.server and self.rollouts:
            raise ParityError("audit: --server samples the prompts of --task or --prompts; "
                              "--rollouts audits answers already saved")
        if not self.server and (self.server_model is not None
                                or self.server_endpoint != "auto"):
            raise ParityError("audit: --server-model and --server-endpoint apply with --server")
        if self.task and self.group < 2:
            # A task's advantages are group-relative: 0, or NaN with the std, in a group of one.
            raise ParityError(f"group={self.group}: a task's advantages are relative to the "
                              f"group of completions of one prompt; group must be >= 2")
        return self


# A message quotes at most this many characters of a value: a value can be megabytes long, and
# the refusal must stay one line a reader can read (docs/errors.md).
QUOTE_LIMIT = 80
_SHORT_REPR = reprlib.Repr()
for _k in ("maxtuple", "maxlist", "maxarray", "maxdict", "maxset", "maxfrozenset", "maxdeque"):
    setattr(_SHORT_REPR, _k, 4)
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxstring = _SHORT_REPR.maxlong = _SHORT_REPR.maxother = QUOTE_LIMIT


def quoted(v: Any) -> str:
    """`repr(v)` for a message, cut to QUOTE_LIMIT characters with `...`. A long string is cut
    before it is repr'd, and a container's repr stops at its first few items and levels, so
    quoting costs little whatever the value holds."""
    text = repr(v[:QUOTE_LIMIT + 1]) if isinstance(v, str) else _SHORT_REPR.repr(v)
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT - 3] + "..."


class _Refused(yaml.YAMLError):
    """A config file YAML reads but parity will not; the message names the line."""


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, with two refusals a config file needs.

    Aliases: an alias is the anchored node itself, not a copy, so nine nested aliases in a few
    hundred bytes stand for 9^9 values, which anything that walks the value (`str`, `repr`)
    expands in memory. Each alias is weighed, as it is read, by the values it stands for;
    past ALIAS_VALUES in all the file is refused. A field holds one value, so anchors in a
    config only ever repeat scalars or merge a few keys (`<<: *base`).

    Keys: YAML requires a mapping's keys to be unique, and PyYAML lets the last one win, so a
    field given twice would silently take its second value. The top mapping's names are
    compared as fields, `-` read as `_`, as `load_yaml` reads them."""

    ALIAS_VALUES = 10_000

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values: dict[int, int] = {}   # id(node) -> the values it stands for, expanded
        self._aliased = 0
        self._root: Any = None

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:   # else PyYAML names the undefined alias
                self._aliased += self._count(node, event)
                if self._aliased > self.ALIAS_VALUES:
                    raise _Refused(f"{_at(event)}: its aliases stand for more than "
                                   f"{self.ALIAS_VALUES} values in all, at alias "
                                   f"*{event.anchor}; a field holds one value")
        return super().compose_node(parent, index)

    def _count(self, node: Any, alias: Any) -> int:
        """The values `node` stands for with every alias in it expanded, counted on the graph
        (each node once), never expanded."""
        if id(node) in self._values:
            return self._values[id(node)]
        if node.end_mark is None:   # still being read: the alias is inside its own anchor
            raise _Refused(f"{_at(alias)}: alias *{alias.anchor} is inside the value it "
                           f"names, which never ends")
        if isinstance(node, yaml.ScalarNode):
            n = 1
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(self._count(x, alias) for x in node.value)
        else:
            n = 1 + sum(self._count(k, alias) + self._count(v, alias) for k, v in node.value)
        self._values[id(node)] = n
        return n

    def construct_document(self, node: Any) -> Any:
        self._root = node
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            self._refuse_repeated_keys(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_repeated_keys(self, node: Any) -> None:
        top = node is self._root
        seen: dict[Any, tuple[str, int]] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue   # `<<: *base`: the keys written beside it are meant to win
            key = self.construct_object(key_node)
            name = key.replace("-", "_") if top and isinstance(key, str) else key
            try:
                first = seen.get(name)
            except TypeError:
                continue   # an unhashable key: PyYAML's own refusal names it
            line = key_node.start_mark.line + 1
            if first is not None:
                as_ = "" if first[0] == key else f" (as {quoted(first[0])} and {quoted(key)})"
                what = "field" if top else "key"
                raise _Refused(f": {what} {quoted(name)} is given twice{as_}, on lines "
                               f"{first[1]} and {line}; YAML would silently keep the last")
            seen[name] = (key, line)


def _at(event: Any) -> str:
    return f", line {event.start_mark.line + 1}, column {event.start_mark.column + 1}"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping of field: value, names with `-` read as `_`; anything else is
    one line naming the file (and the line, where YAML gives one). Read by `_ConfigLoader`:
    no alias expands past a small budget, no field is given twice."""
    p = Path(path)
    text = read_text(p, "config file")
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise ParityError(f"config file {p}{e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or one_line(e)
        raise ParityError(f"config file {p} is not valid YAML{at}: {problem}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # YAML's own constructors: a date that is no date, an integer too long to convert
        raise ParityError(f"config file {p} is not valid YAML: {one_line(e)}") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ParityError(f"config file {p} must hold a mapping of field: value, not a "
                          f"{type(data).__name__}")
    for k in data:
        if not isinstance(k, str):
            raise ParityError(f"config file {p}: field name {quoted(k)} is not text")
    return {k.replace("-", "_"): v for k, v in data.items()}


def make_config(explicit: dict[str, Any]) -> Config:
    """defaults < recipe < the built-in task's defaults < explicit values (YAML, then flags)."""
    explicit = {k: coerce(k, v) for k, v in explicit.items()}
    recipe = explicit.get("recipe", Config.recipe)
    if recipe not in RECIPES:
        raise ParityError(f"unknown recipe {quoted(recipe)}; known recipes: "
                          f"{', '.join(RECIPES)}")
    values: dict[str, Any] = dict(RECIPES[recipe].settings)
    values.update(TASK_DEFAULTS.get(explicit.get("task", Config.task), {}))
    preset = dict(values)
    values.update(explicit)
    values["recipe"] = recipe

    def changed(k: str) -> bool:  # set by the user to something the recipe does not say
        return k in explicit and explicit[k] != preset.get(k, getattr(Config, k))
    _check_clip_ranges(values.get("objective", Config.objective),
                       [k for k in ("eps_low", "eps_high", "seq_eps_low", "seq_eps_high")
                        if changed(k)])
    return Config(**values).validate()


def _check_clip_ranges(objective: str, given: list[str]) -> None:
    """Refuse a clip range the objective does not use. Only ranges the user set count: every
    recipe sets both kinds."""
    if objective not in OBJECTIVES:
        return  # validate names the choices
    clip = OBJECTIVES[objective].clip
    for k in given:
        sequence = k.startswith("seq_")
        if clip is None:
            raise ParityError(f"objective={objective} has no clip; {k} does not apply")
        if clip == "sequence" and not sequence:
            raise ParityError(f"objective={objective} clips the sequence ratio with seq_eps_low/"
                              f"seq_eps_high; {k} (a token clip range) does not apply")
        if clip == "token" and sequence:
            raise ParityError(f"{k} is GSPO's sequence clip range; objective={objective} "
                              f"clips tokens with eps_low/eps_high")


def dump_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
