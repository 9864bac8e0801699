"""The one typed config of a parity run (`Config`): every field with its default, help and checks,
and the rules that tie fields together.

Every field carries its documentation in `metadata["help"]` and its checks: choices in its
`Literal` type (or, for an objective or an engine, in its registry: `metadata["choices"]`),
bounds in `metadata["range"]`. The CLI builds its flags from them and `check_fields` validates
from them. Settings that repeat a field of Config (the audit's, the TRL integration's) take it
with `shared`, so each is written once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from parity.config.fields import (
    DEVICE_PATTERN,
    REPORT_TO,
    Correction,
    CpuFp16,
    DpoRef,
    Dtype,
    Kernels,
    LossAgg,
    OptimizerName,
    Parallel,
    RatioSource,
    ShadowKernels,
    _f,
    check_fields,
    own,
    quoted,
)
from parity.engines import ENGINES, EngineNeeds, refuse_unable
from parity.errors import ParityError
from parity.objectives import OBJECTIVES


def engine_needs(c: Any) -> EngineNeeds:
    """What the settings `c` (a Config, AuditSettings, or the TRL integration's) ask of the
    engine, for its registry entry to refuse what it cannot do (parity/engines/abilities.py)."""
    adapters = getattr(c, "lora_rank", 0) or getattr(c, "adapter", None)
    return EngineNeeds(lm_head_fp32=c.lm_head_fp32, routing=getattr(c, "routing_replay", False),
                       lora_unmerged=bool(adapters)
                       and not c.lora_merge, scores=c.shadow_kernels == "scored",
                       temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                       min_p=getattr(c, "min_p", 0.0),
                       repetition_penalty=getattr(c, "repetition_penalty", 1.0),
                       trace=bool(getattr(c, "locate", False)),
                       invariant=getattr(c, "kernels", "default") == "invariant")


def check_kernels(c: Any) -> None:
    """Where kernels=invariant cannot make both sides compute the same bits (a Config or
    AuditSettings `c`), refused in one line."""
    if c.kernels != "invariant":
        return
    if c.trainer_dtype != c.engine_dtype:
        raise ParityError(f"kernels=invariant runs the trainer's forward in the engine's dtype: "
                          f"trainer_dtype={c.trainer_dtype} must be engine_dtype="
                          f"{c.engine_dtype} (the `bitwise` recipe sets both)")
    adapters = getattr(c, "lora_rank", 0) or getattr(c, "adapter", None)
    if adapters and getattr(c, "lora_merge", True):
        raise ParityError("kernels=invariant with LoRA needs --no-lora-merge: the engine must "
                          "apply the adapters as the trainer does, W x + (α/r) B (A x), not "
                          "the merged W + (α/r) B A (docs/zero-mismatch.md)")
    for flag, on in (("--parallel fsdp", getattr(c, "parallel", None) == "fsdp"),
                     ("--server", getattr(c, "server", None))):
        if on:
            raise ParityError(f"kernels=invariant does not hold with {flag} yet: the engine "
                              f"would not compute the trainer's forward (docs/zero-mismatch.md)")


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
                                "at is_cap), token-icepop (per token, mask outside [is_cap_low, "
                                "is_cap]: IcePop), seq-tis|seq-mis (per sequence), geo-rs (reject "
                                "sequences whose geometric-mean weight is beyond geo_cap).")
    is_cap: float = _f(2.0, "C of TIS/MIS: weights above it are truncated or masked; also the "
                       "truncation of pg-is's sequence weight.", ge=1)
    is_cap_low: float = _f(0.5, "token-icepop: weights below it are masked too (IcePop's lower "
                           "bound; is_cap is its upper).", gt=0, le=1)
    geo_cap: float = _f(1.01, "geo-rs: reject a sequence when exp(|mean_t log w|) exceeds this.",
                        ge=1)
    eps_low: float | None = _f(0.2, "Lower clip range: ratios below 1 - eps_low are clipped for "
                               "A < 0. None disables clipping.", ge=0, lt=1)
    eps_high: float | None = _f(0.2, "Upper clip range: ratios above 1 + eps_high are clipped for "
                                "A > 0. None disables clipping.", ge=0)
    seq_eps_low: float | None = _f(3e-4, "GSPO's own lower clip range on the sequence's "
                                   "geometric-mean ratio (None: no clip).", ge=0, lt=1)
    seq_eps_high: float | None = _f(4e-4, "GSPO's own upper clip range (None: no clip).", ge=0)
    # -- LoRA (parity/models/lora.py; docs/lora.md)
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
    routing_replay: bool = _f(False, "A mixture of experts: every trainer forward (l_pi, l_old, "
                              "the shadow, the reference) routes each token to the experts the "
                              "engine chose, with gate weights from its own router over them "
                              "(Rollout Routing Replay, R3; docs/moe.md). Needs an engine that "
                              "records its routing.")
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
    kernels: Kernels = _f("default", "`invariant`: the engine and the trainer compute the same "
                          "bits (docs/zero-mismatch.md): matrix products with their rows padded "
                          "to a fixed tile, attention summed in fixed blocks of keys, the "
                          "trainer's forward in the engine's dtype over the fp32 master weights; "
                          "parity's engine only. `default`: each side's own kernels.")
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
    max_consecutive_skips: int = _f(20, "Stop the run after this many updates in a row skipped "
                                    "for a non-finite gradient (a loss, l_pi or gradient that "
                                    "is NaN or inf; with fp16 also a loss scale that overflows, "
                                    "which halves it each time, so 20 take 2^16 to 2^-4); the "
                                    "weights stay those of the last applied update and the "
                                    "checkpoints as written. 0: never stop.", ge=0)
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
    logprob_chunk: int = _f(0, "Completion tokens whose vocabulary-wide logits exist at once "
                            "when scoring; each chunk's are recomputed in the backward. 0: as "
                            "many as 128 MiB of fp32 logits hold on the CPU, 1 GiB on a GPU "
                            "(220 and 1,766 at Qwen3's 151,936-token vocabulary), the first "
                            "1 GiB of them kept for the backward rather than recomputed; -1: "
                            "every position of a forward at once, one [tokens, vocabulary] "
                            "tensor.", ge=-1)
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
    temperature: float = _f(1.0, "Sampling temperature; the trainer scores with the same one. "
                            "0 (greedy decoding) draws no token from a distribution, so no "
                            "sampling log-prob exists for the ratio.", gt=0)
    top_p: float = _f(1.0, "Nucleus sampling mass (1.0 disables; 0 keeps the likeliest token "
                      "alone, as transformers does).", ge=0, le=1)
    top_k: int = _f(0, "Keep the k most likely tokens (0 disables).", ge=0)
    # -- diagnostics (parity/diagnostics.py)
    diagnostics: bool = _f(True, "Shadow forward on every update (one no-grad forward in engine "
                           "precision): alpha/beta per token and every clip attributed to "
                           "policy change or numerics. Off: clip/frac and the KL estimates only.")
    kl_exact_rows: int = _f(4, "Completions per step whose whole engine distribution is kept for "
                            "the exact KL(mu||pi), at their first positions: 64 MiB of fp32 a "
                            "row (110 positions at Qwen3's vocabulary); 0: off.", ge=0)
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
    vllm_cuda_graphs: bool = _f(True, "engine=vllm on a GPU: decode steps replay CUDA graphs "
                                "captured at start (without torch.compile), as TRL's vLLM "
                                "decodes; off: eager decoding. On the CPU vLLM always runs "
                                "eager (docs/vllm.md).")
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
                        "that is installed (wandb not under WANDB_MODE=disabled); `none`.")

    def validate(self) -> "Config":
        """Refuse bad settings before any work starts, with one line naming the field: every
        field's own checks (`check_fields`), then the rules that tie fields together."""
        check_fields(self)
        objective = OBJECTIVES[self.objective]
        self._check_scale(objective.value_head)
        self._check_lora()
        self._check_engine()
        check_kernels(self)
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


FIELDS = {f.name: f for f in dataclasses.fields(Config)}

def shared(name: str, *, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
    """Config's field `name`, for settings that repeat it (the audit's, the TRL integrations'):
    its default, help and checks come from Config, its type is declared beside it (and
    tests/test_settings.py holds it to Config's). `default` and `help` replace Config's only
    where the field means something else there."""
    f = FIELDS[name]
    meta = {**f.metadata, **({"help": help} if help is not None else {})}
    return field(default=f.default if default is dataclasses.MISSING else default, metadata=meta)



@dataclass(kw_only=True)
class SamplingArgs:
    """Another framework's sampling arguments (TRL's GRPOConfig), checked as transformers checks
    them before it samples and as Config checks its own: a value transformers refuses, or one
    with no sampling log-prob for the ratio, stops the run before any step."""
    temperature: float = shared("temperature")
    top_p: float = shared("top_p")
    top_k: int = shared("top_k")
    min_p: float = own(0.0, "Drop tokens less likely than min_p times the likeliest (0 "
                       "disables).", ge=0, le=1)
    repetition_penalty: float = own(1.0, "Divide a seen token's positive logit by it, multiply "
                                    "a negative one (1 disables).", gt=0)

    @classmethod
    def check(cls, owner: str, **values: Any) -> None:
        """Refuse a bad value in one line naming `owner`'s field; None is unset."""
        if values.get("temperature") == 0:
            raise ParityError(f"{owner}.temperature=0 is greedy decoding: it draws no token from "
                              f"a distribution, so no sampling log-prob exists for the ratio "
                              f"(as with beam search); set temperature > 0")
        try:
            check_fields(cls(**{k: v for k, v in values.items() if v is not None}))
        except ParityError as e:
            raise ParityError(f"{owner}.{e}") from None


# The built-in tasks' own defaults, applied over the recipe and under YAML and flag values. The
# model names are testbed models (parity/testbed.py SPECS) or built-in pretrained ones
# (parity/models/pretrained.py); the chat task's lr is TRL's GRPOConfig default.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "neg-length": dict(model="text", lr=3e-4, steps=30, max_new_tokens=24),
    "neg-length-chat": dict(model="smollm2-135m", lr=1e-6, steps=20, max_new_tokens=64),
    "arith": dict(model="arith", lr=3e-4, steps=800, prompts_per_step=16, max_new_tokens=8),
}


