"""The one typed config of a parity run, and recipes: named presets of it.

Precedence, lowest first: field defaults, the recipe's preset, the built-in task's defaults, a
YAML file (`--config`), command-line flags. Every field carries its documentation in
`metadata["help"]`; the CLI builds its flags from it, so the docs live in one place.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from parity.errors import ParityError

DTYPES = ("fp32", "bf16", "fp16")
RATIO_SOURCES = ("engine", "shadow", "recompute")
CORRECTIONS = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis", "geo-rs")
OBJECTIVES = ("ppo-clip", "gspo", "pg-is", "ppo-value", "online-dpo")
LOSS_AGGS = ("seq-mean", "token-mean", "token-sum")
DPO_REFS = ("initial", "engine")
OPTIMIZERS = ("adamw", "adam", "sgd")
ENGINES = ("hf", "vllm")
PARALLEL = ("ddp", "fsdp")
REPORT_TO = ("auto", "none", "tensorboard", "wandb")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # -- what to train
    recipe: str = _f("bf16-engine", "Named preset of precision, ratio source, clip and correction "
                     "(`parity recipes` lists them); explicit fields override it.")
    task: str = _f("neg-length", "Task: `neg-length`, `arith`, or a dataset file (JSONL/parquet "
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
    engine: str = _f("hf", "Rollout engine: `hf` (transformers model with a KV cache, CPU or "
                     "GPU) or `vllm` (vLLM on a CUDA GPU, `pip install 'parity[vllm]'`; "
                     "unverified so far, docs/scaling.md).")
    engine_dtype: str = _f("bf16", "Precision of the engine's copy of the weights: fp32|bf16|fp16.")
    trainer_dtype: str = _f("fp32", "Trainer compute precision: fp32, or bf16/fp16 autocast over "
                            "fp32 master weights.")
    ratio_source: str = _f("engine", "Denominator of the PPO ratio: `engine` (log r = l_pi - "
                           "l_mu, beta inside the clip), `shadow` (value l_s - l_mu from the "
                           "engine-precision shadow forward, gradient through l_pi), `recompute` "
                           "(l_pi - l_old, l_old recomputed by the trainer before the first update).")
    correction: str = _f("none", "Behaviour weights w = exp(l_old - l_mu) with `recompute`: none, "
                         "token-tis|token-mis (per token, truncate|mask at is_cap), "
                         "seq-tis|seq-mis (per sequence), geo-rs (reject sequences whose "
                         "geometric-mean weight is beyond geo_cap).")
    is_cap: float = _f(2.0, "C of TIS/MIS: weights above it are truncated or masked; also the "
                       "truncation of pg-is's sequence weight.")
    geo_cap: float = _f(1.01, "geo-rs: reject a sequence when exp(|mean_t log w|) exceeds this.")
    eps_low: float | None = _f(0.2, "Lower clip range: ratios below 1 - eps_low are clipped for "
                               "A < 0. None disables clipping.")
    eps_high: float | None = _f(0.2, "Upper clip range: ratios above 1 + eps_high are clipped for "
                                "A > 0. None disables clipping.")
    seq_eps_low: float | None = _f(3e-4, "GSPO's own lower clip range on the sequence's "
                                   "geometric-mean ratio (None: no clip).")
    seq_eps_high: float | None = _f(4e-4, "GSPO's own upper clip range (None: no clip).")
    lm_head_fp32: bool = _f(False, "Compute the LM head in fp32 on both sides (engine and "
                            "trainer), whatever the dtype of the rest.")
    cpu_fp16: str = _f("emulate", "How fp16 matrix products run on CPU: `emulate` (fp16 inputs, "
                       "fp32 accumulation, fp16 output, as GPU tensor cores; fast) or `native` "
                       "(torch's CPU fp16 kernels; several times slower: bench/fp16_cpu.py).")
    loss_scale_init: float = _f(2.0**16, "fp16 only: initial dynamic loss scale.")
    loss_scale_growth_interval: int = _f(400, "fp16 only: overflow-free updates before the loss "
                                         "scale doubles.")
    # -- objective
    objective: str = _f("ppo-clip", "Policy objective: `ppo-clip` (token PPO-clip, GRPO "
                        "advantages), `gspo` (sequence geometric-mean ratio, own clip range), "
                        "`pg-is` (REINFORCE with truncated sequence importance weights, no clip), "
                        "`ppo-value` (PPO-clip with a learned value head and GAE), `online-dpo` "
                        "(best vs worst completion of each group, DPO loss).")
    loss_agg: str = _f("seq-mean", "Loss aggregation of token objectives: `seq-mean` (GRPO), "
                       "`token-mean` (DAPO: every token of the minibatch weighs the same), "
                       "`token-sum` (Dr.GRPO: token sum over minibatch size x max_new_tokens).")
    value_coef: float = _f(0.1, "ppo-value: weight of the value loss.")
    value_clip: float | None = _f(0.2, "ppo-value: clip of the value update (None: no clip).")
    gae_gamma: float = _f(1.0, "ppo-value: GAE discount.")
    gae_lambda: float = _f(0.95, "ppo-value: GAE lambda.")
    dpo_scale: float = _f(0.1, "online-dpo: DPO's temperature (DPO papers call it beta; here "
                          "beta is the precision gap).")
    dpo_ref: str = _f("initial", "online-dpo reference: `initial` (the starting policy, frozen) "
                      "or `engine` (the engine's log-probs l_mu, so the precision gap enters the "
                      "margin: reported as dpo/margin_beta).")
    scale_rewards: bool = _f(True, "Divide group-centred rewards by the group's std (GRPO); "
                             "False keeps only the centring (Dr.GRPO).")
    # -- optimisation
    optimizer: str = _f("adamw", "Optimizer over the fp32 master weights: adamw|adam|sgd.")
    lr: float = _f(1e-5, "Learning rate (built-in tasks set their own default).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (<= 0 disables).")
    steps: int = _f(100, "RL steps, each a rollout and its updates (built-in tasks set their "
                    "own default).")
    prompts_per_step: int = _f(8, "Distinct prompts sampled per step.")
    samples_per_prompt: int = _f(8, "Completions per prompt (the GRPO group size).")
    minibatches: int = _f(1, "Optimizer steps per epoch: the step's completions split this many "
                          "ways (by whole groups).")
    epochs: int = _f(1, "Passes over the step's completions.")
    # -- sampling
    max_new_tokens: int = _f(64, "Max completion tokens, EOS included (built-in tasks set "
                             "their own default).")
    temperature: float = _f(1.0, "Sampling temperature; the trainer scores with the same one.")
    top_p: float = _f(1.0, "Nucleus sampling mass (1.0 disables).")
    top_k: int = _f(0, "Keep the k most likely tokens (0 disables).")
    # -- diagnostics (parity/diagnostics.py)
    diagnostics: bool = _f(True, "Shadow forward on every update (one no-grad forward in engine "
                           "precision): alpha/beta per token and every clip attributed to "
                           "policy change or numerics. Off: clip/frac and the KL estimates only.")
    kl_exact_rows: int = _f(4, "Completions per step whose whole engine distribution is kept for "
                            "the exact KL(mu||pi) over the vocabulary (costs rows x length x "
                            "vocab floats; 0 disables).")
    dump_rollouts: int = _f(0, "Write rollouts/step-N.parquet (one row per token per update) "
                            "every N steps; `--dump-rollouts` alone means every step; 0: off.",
                            const=1)
    # -- scale (docs/scaling.md)
    async_engine: bool = _f(False, "Run the engine in its own process: it samples the next "
                            "steps' rollouts while the trainer learns, from weights at most "
                            "`max_staleness` optimizer steps old (alpha then carries the "
                            "staleness; `async/staleness` reports it per step).")
    max_staleness: int = _f(1, "Async: a rollout is sampled from the weights of exactly this many "
                            "steps ago, once there are that many (fewer right after the start "
                            "or a sync_every gap); 0 waits for the newest weights, as the "
                            "synchronous loop does.")
    sync_every: int = _f(1, "Async: push the trainer's weights to the engine every N steps "
                         "(1 <= N <= max_staleness + 1, so no rollout is staler than "
                         "max_staleness).")
    engine_threads: int = _f(0, "Async: torch threads of the engine process (0: one). The "
                             "trainer keeps `threads`: split the cores with both when sampling "
                             "is the longer side.")
    vllm_gpu_memory: float = _f(0.3, "engine=vllm: share of the GPU's memory vLLM may take "
                                "(weights and KV cache).")
    parallel: str = _f("ddp", "Multi-process runs (torchrun / accelerate launch): `ddp` (every "
                       "rank holds the model) or `fsdp` (parameters, gradients and optimizer "
                       "state sharded with FSDP2's fully_shard).")
    dist_timeout_s: float = _f(600.0, "Multi-process: seconds a rank waits for the others in a "
                               "collective before the run stops with an error.")
    # -- bookkeeping
    seed: int = _f(0, "Seed for data order, sampling and initialisation of anything random.")
    out: str | None = _f(None, "Run directory. None: runs/<task>-<recipe>-s<seed>.")
    save_every: int = _f(100, "Save a checkpoint every N steps (0: only at the end); "
                         "`parity train --resume RUN` continues from the newest.")
    keep_checkpoints: int = _f(3, "Keep the newest K checkpoints (0: all).")
    threads: int = _f(0, "torch CPU threads (0: torch's default).")
    progress: bool = _f(True, "Show a progress bar.")
    report_to: str = _f("auto", "Metric backends besides metrics.jsonl (always written), "
                        "comma-separated: `tensorboard`, `wandb` (offline mode); `auto`: each one "
                        "that is installed; `none`.")

    def validate(self) -> "Config":
        """Refuse bad settings before any work starts, with one line naming the field."""
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            v = getattr(self, name)
            if v not in allowed:
                raise ParityError(f"{name}={v!r} is not one of: {', '.join(allowed)}")
        if self.recipe not in RECIPES:
            raise ParityError(f"unknown recipe {self.recipe!r}; known recipes: "
                              f"{', '.join(RECIPES)}")
        for name in ("engine_dtype", "trainer_dtype"):
            choice(name, DTYPES)
        choice("engine", ENGINES)
        choice("parallel", PARALLEL)
        if self.max_staleness < 0:
            raise ParityError(f"max_staleness={self.max_staleness} must be >= 0")
        if not 1 <= self.sync_every <= self.max_staleness + 1:
            raise ParityError(f"sync_every={self.sync_every} must be in [1, max_staleness + 1 = "
                              f"{self.max_staleness + 1}]: rarer pushes would leave rollouts "
                              f"staler than max_staleness")
        if self.sync_every != 1 and not self.async_engine:
            raise ParityError(f"sync_every={self.sync_every} applies to the asynchronous engine: "
                              f"add --async-engine")
        if self.parallel == "fsdp" and self.objective == "ppo-value":
            raise ParityError("objective=ppo-value keeps its value head outside the FSDP-sharded "
                              "model: use parallel=ddp")
        if self.engine == "vllm" and (self.async_engine or self.lm_head_fp32):
            raise ParityError("engine=vllm samples in the trainer's process: it takes neither "
                              "--async-engine nor --lm-head-fp32")
        if not 0 < self.vllm_gpu_memory <= 1:
            raise ParityError(f"vllm_gpu_memory={self.vllm_gpu_memory} must be in (0, 1]")
        if self.engine_threads < 0:
            raise ParityError(f"engine_threads={self.engine_threads} must be >= 0")
        if not (self.dist_timeout_s > 0 and math.isfinite(self.dist_timeout_s)):
            raise ParityError(f"dist_timeout_s={self.dist_timeout_s} must be a finite number > 0")
        choice("cpu_fp16", ("emulate", "native"))
        choice("ratio_source", RATIO_SOURCES)
        choice("correction", CORRECTIONS)
        choice("objective", OBJECTIVES)
        choice("loss_agg", LOSS_AGGS)
        choice("optimizer", OPTIMIZERS)
        choice("dpo_ref", DPO_REFS)
        for name in ("eps_low", "eps_high", "seq_eps_low", "seq_eps_high"):
            v = getattr(self, name)
            if v is not None and not (0 <= v and math.isfinite(v)):
                raise ParityError(f"{name}={v} must be a finite number >= 0 (or null for no clip)")
        for name in ("eps_low", "seq_eps_low"):
            v = getattr(self, name)
            if v is not None and v >= 1:
                raise ParityError(f"{name}={v} must be < 1 (the ratio cannot fall to 0)")
        if self.correction != "none" and self.ratio_source != "recompute":
            raise ParityError(f"correction={self.correction!r} reweights by exp(l_old - l_mu) and "
                              f"needs ratio_source=recompute (it is {self.ratio_source!r}); "
                              f"the `tis` and `seq-mis` recipes set both")
        if not (self.is_cap >= 1 and math.isfinite(self.is_cap)):
            raise ParityError(f"is_cap={self.is_cap} must be a finite number >= 1")
        if not (self.geo_cap >= 1 and math.isfinite(self.geo_cap)):
            raise ParityError(f"geo_cap={self.geo_cap} must be a finite number >= 1")
        if not (self.dpo_scale > 0 and math.isfinite(self.dpo_scale)):
            raise ParityError(f"dpo_scale={self.dpo_scale} must be a finite number > 0")
        if not (self.value_coef >= 0 and math.isfinite(self.value_coef)):
            raise ParityError(f"value_coef={self.value_coef} must be a finite number >= 0")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ParityError(f"value_clip={self.value_clip} must be > 0 (or null)")
        for name in ("gae_gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ParityError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.objective == "online-dpo" and self.samples_per_prompt < 2:
            raise ParityError("objective=online-dpo pairs completions of one prompt: "
                              "samples_per_prompt must be >= 2")
        positive = ("prompts_per_step", "samples_per_prompt", "minibatches", "epochs",
                    "loss_scale_growth_interval")
        for name in positive + ("steps", "max_new_tokens"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ParityError(f"{name}={v} must be > 0")
        if self.model is None:
            raise ParityError(f"task {self.task!r} has no default model: give --model NAME|DIR")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ParityError(f"lr={self.lr} must be a finite number > 0")
        if self.prompts_per_step % self.minibatches:
            raise ParityError(f"prompts_per_step={self.prompts_per_step} must be divisible by "
                              f"minibatches={self.minibatches} (minibatches hold whole groups)")
        if not (self.temperature > 0):
            raise ParityError(f"temperature={self.temperature} must be > 0")
        if not (0 < self.top_p <= 1):
            raise ParityError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ParityError(f"top_k={self.top_k} must be >= 0")
        for name in ("kl_exact_rows", "dump_rollouts"):
            if getattr(self, name) < 0:
                raise ParityError(f"{name}={getattr(self, name)} must be >= 0")
        if self.keep_checkpoints < 0:
            raise ParityError(f"keep_checkpoints={self.keep_checkpoints} must be >= 0")
        if self.save_every < 0:
            raise ParityError(f"save_every={self.save_every} must be >= 0")
        self.reward_weight_list()
        for name in self.report_to.split(","):
            if name.strip() not in REPORT_TO:
                raise ParityError(f"report_to: {name.strip()!r} is not one of: "
                                  f"{', '.join(REPORT_TO)}")
        return self

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
            raise ParityError(f"reward_weights={self.reward_weights!r} must be comma-separated "
                              f"numbers") from None
        if len(w) != len(specs):
            raise ParityError(f"reward_weights has {len(w)} values for {len(specs)} reward "
                              f"functions (reward={self.reward!r})")
        if not all(math.isfinite(x) for x in w):
            raise ParityError(f"reward_weights={self.reward_weights!r} must be finite")
        return w

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    settings: dict[str, Any]


def _mismatch(**kw: Any) -> dict[str, Any]:
    """bf16 engine against an fp32 trainer, with the fix's own settings on top."""
    base = dict(engine_dtype="bf16", trainer_dtype="fp32", ratio_source="engine", eps_low=0.2,
                eps_high=0.2, seq_eps_low=3e-4, seq_eps_high=4e-4, correction="none")
    return {**base, **kw}


# DESIGN.md's table: the mismatch, the fixes, and the references.
RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16-engine", "The mismatch: bf16 engine, fp32 trainer, engine log-probs in the ratio.",
           _mismatch()),
    Recipe("bf16-shadow", "Beta out of the ratio: its value comes from a bf16 shadow forward on "
           "the trainer's weights, its gradient from the fp32 forward.",
           _mismatch(ratio_source="shadow")),
    Recipe("wide-eps", "The mismatch with a wider clip range (DAPO's clip-higher 0.28; GSPO's "
           "doubled); set eps_high/eps_low to taste.",
           _mismatch(eps_high=0.28, seq_eps_high=8e-4)),
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
# model names are testbed models (parity/testbed.py SPECS).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "neg-length": dict(model="text", lr=3e-4, steps=30, max_new_tokens=24),
    "arith": dict(model="arith", lr=3e-4, steps=800, prompts_per_step=16, max_new_tokens=8),
}

FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML or flag value to the field's type, or raise ParityError naming the field."""
    if name not in FIELDS:
        raise ParityError(f"unknown config field {name!r}")
    kind = str(FIELDS[name].type)
    optional = "None" in kind
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ParityError(f"{name} cannot be empty")
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind.startswith("int"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError(value)
            return int(float(value))
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ParityError(f"{name}={value!r} is not a valid {kind.split(' ')[0]}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ParityError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParityError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ParityError(f"config file {p} must hold a mapping of field: value")
    return {k.replace("-", "_"): v for k, v in data.items()}


def make_config(explicit: dict[str, Any]) -> Config:
    """defaults < recipe < the built-in task's defaults < explicit values (YAML, then flags)."""
    explicit = {k: coerce(k, v) for k, v in explicit.items()}
    recipe = explicit.get("recipe", Config.recipe)
    if recipe not in RECIPES:
        raise ParityError(f"unknown recipe {recipe!r}; known recipes: {', '.join(RECIPES)}")
    values: dict[str, Any] = dict(RECIPES[recipe].settings)
    values.update(TASK_DEFAULTS.get(explicit.get("task", Config.task), {}))
    preset = dict(values)
    values.update(explicit)
    values["recipe"] = recipe
    objective = values.get("objective", Config.objective)

    def changed(k: str) -> bool:  # set by the user to something the recipe does not say
        return k in explicit and explicit[k] != preset.get(k, getattr(Config, k))
    token_eps = [k for k in ("eps_low", "eps_high") if changed(k)]
    if objective == "gspo" and token_eps:
        raise ParityError(f"objective=gspo clips the sequence ratio with seq_eps_low/"
                          f"seq_eps_high; {token_eps[0]} (a token clip range) does not apply")
    if objective in ("pg-is", "online-dpo") and token_eps:
        raise ParityError(f"objective={objective} has no clip; {token_eps[0]} does not apply")
    seq_eps = [k for k in ("seq_eps_low", "seq_eps_high") if changed(k)]
    if objective != "gspo" and seq_eps:
        raise ParityError(f"{seq_eps[0]} is GSPO's sequence clip range; objective={objective} "
                          f"clips tokens with eps_low/eps_high")
    return Config(**values).validate()


def dump_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
