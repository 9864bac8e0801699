"""parity inside TRL's GRPOTrainer: the α/β diagnostics, the shadow ratio and the FP16 fix.

    from trl import GRPOConfig
    from parity.integrations.trl import ParityGRPOTrainer, ParityOptions

    trainer = ParityGRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[my_reward],
        train_dataset=dataset, args=GRPOConfig(output_dir="out", use_cpu=True),
        parity=ParityOptions.from_recipe("bf16-shadow"))
    trainer.train()   # TRL's log now carries clip/phantom_frac, mismatch/beta_abs_mean, ...

A subclass, because TRL's extension points for generation (`rollout_func`) cannot reach the
loss; it overrides three methods of GRPOTrainer and leaves the rest (datasets, rewards,
advantages, the loss itself, logging, checkpoints) to TRL:

- `_generate_single_turn`: completions come from a parity engine (`engine`: `hf`, its own, or
  `vllm` in this process, behind the same `Engine` interface), a copy of the policy in
  `engine_dtype`. It records ℓ_μ, each sampled token's log-prob under the distribution it was
  drawn from, which TRL keeps as `sampling_per_token_logps`.
- `_get_per_token_logps_and_entropies`: in the loss, the shadow forward (the current weights
  cast to engine precision, no grad, at the engine's position ids) gives ℓ_s next to the
  trainer's ℓ_π; with `shadow_kernels='scored'` the engine itself scores the sequences on the
  current weights (`Engine.score`), so ℓ_s carries no kernel gap against ℓ_μ. Where the
  sampling distribution truncates or penalises repetitions, every log-prob is taken under it
  rather than through TRL's fused head (`trl_sampling.token_logps`).
- `_compute_loss`: sets the ratio's denominator by `ratio_source`, then attributes every clip
  (clipped, phantom, hidden: docs/design.md) and appends parity's metrics to TRL's
  `_metrics` (over every rank's tokens), so they reach TRL's log and every `report_to`
  backend under parity's names:

      engine     log r = ℓ_π − ℓ_μ                      (TRL's AsyncGRPO; β inside the clip)
      shadow     log r = ℓ_s − ℓ_μ, gradient via ℓ_π    (β out of the ratio)
      recompute  TRL's own ratio, ℓ_π − ℓ_old            (ℓ_old recomputed by the trainer)

Around them: GRPOConfig's sampling arguments are checked and its defaults adapted to the recipe,
one line per change (trl_config.py), and an update from a non-finite gradient is skipped,
counted and, too many in a row, stopped (trl_updates.py).

With `GRPOConfig(use_vllm=True)` TRL's own vLLM samples instead, colocated or a server
(parity/integrations/trl_vllm.py): parity keeps TRL's sampling and its ℓ_μ, and checks that
vLLM returns processed log-probs in the recipe's engine precision.

Trainer precision is GRPOConfig's (`bf16=True`, `fp16=True`). On CPU accelerate silently runs
`fp16=True` in fp32, so parity supplies what it leaves out: fp16 autocast (tensor-core numerics
emulated, parity/models/precision.py, also in gradient checkpointing's recomputation) and a dynamic
loss scaler on accelerate's own hooks.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import datasets
import torch

from parity import cpu_bf16
from parity import metric_names as mn
from parity.config import (
    FIELDS,
    CpuFp16,
    Dtype,
    RatioSource,
    ShadowKernels,
    check_fields,
    engine_needs,
    recipe,
    shared,
)
from parity.diagnostics import Attribution, StepDiagnostics, measure
from parity.engines import VLLM, EngineSpec, check_engine, make_engine, refuse_unable
from parity.errors import ParityError
from parity.integrations import trl_config, trl_routing, trl_vllm
from parity.integrations.trl_sampling import (
    bypassed,
    check_sampling,
    effective_config,
    token_logps,
    warn_bypassed,
)
from parity.integrations.trl_updates import UpdateGuard
from parity.logprobs import Rollout, Sampling, positions
from parity.models import routing
from parity.models.attention import ENGINE_ATTENTION
from parity.models.forward import disable_dropout
from parity.models.loading import max_positions
from parity.models.precision import (
    cast_weights_into,
    checkpoint_under_emulation,
    fp16_kernels,
    low_precision_copy,
)
from parity.runs.distributed import Dist
from parity.runs.finite import LeftOut, usable_tokens
from parity.tasks import check_fits

try:
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("parity.integrations.trl needs TRL: pip install 'parity[trl]'") from e

logger = logging.getLogger(__name__)

CLIPPING_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


# TRL's own correction on vLLM's samples, per parity correction: the same weights
# (objectives/losses.py); geo-rs has none.
TRL_CORRECTION = {"token-tis": "token_truncate", "token-mis": "token_mask",
                  "token-icepop": "token_mask", "seq-tis": "sequence_truncate",
                  "seq-mis": "sequence_mask"}


def _trl_correction(st: dict[str, Any]) -> str:
    """The GRPOConfig settings that apply a recipe's correction, as text for a refusal."""
    mode = TRL_CORRECTION.get(st["correction"])
    if mode is None:
        return f"no correction: TRL has none like {st['correction']}"
    low = (f", vllm_importance_sampling_clip_min={st['is_cap_low']}"
           if st["correction"] == "token-icepop" else "")
    return (f"GRPOConfig(use_vllm=True, vllm_importance_sampling_mode={mode!r}, "
            f"vllm_importance_sampling_clip_max={st.get('is_cap', FIELDS['is_cap'].default)}"
            f"{low})")


# Config's fields, so the choices, defaults and help of `parity train` hold here too. Only
# `trainer_dtype` differs: GRPOConfig's flags set the trainer's precision, and None accepts them.
@dataclass(kw_only=True)
class ParityOptions:
    """What parity changes in GRPOTrainer; every other setting stays GRPOConfig's."""
    engine: str = shared("engine")
    engine_dtype: Dtype = shared("engine_dtype")
    ratio_source: RatioSource = shared("ratio_source")
    diagnostics: bool = shared("diagnostics", help="Shadow forward on every loss call: alpha/beta "
                               "per token and each clip attributed (clip/phantom_frac, "
                               "mismatch/...). Off: none of parity's metrics.")
    trainer_dtype: Dtype | None = shared(
        "trainer_dtype", default=None,
        help="The trainer precision these options expect (recipes set it); GRPOConfig's bf16/fp16 "
             "flags are set to it, one line saying which changed. None: whatever GRPOConfig "
             "says.")
    cpu_fp16: CpuFp16 = shared("cpu_fp16")
    shadow_kernels: ShadowKernels = shared("shadow_kernels")
    max_consecutive_skips: int = shared("max_consecutive_skips")
    recipe: str | None = shared("recipe", default=None, help="The recipe these options come "
                                "from (from_recipe sets it), named where parity changes a "
                                "GRPOConfig setting for it.")

    def validate(self) -> ParityOptions:
        check_fields(self)
        return self

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> ParityOptions:
        """A parity recipe's precision and ratio source. Recipes whose fix lives elsewhere are
        refused with where to set it instead."""
        st = recipe(name, "the TRL trainers").settings
        if st["correction"] != "none":
            raise ParityError(f"recipe {name!r} reweights by exp(l_old - l_mu), which TRL's "
                              f"GRPOTrainer applies only to vLLM samples: use "
                              f"from_recipe('recompute') with {_trl_correction(st)}")
        # GRPOConfig's epsilon sets the clip range: a recipe may only keep Config's own.
        if (st["eps_low"], st["eps_high"]) != (FIELDS["eps_low"].default,
                                               FIELDS["eps_high"].default):
            raise ParityError(f"recipe {name!r} changes the clip range, which is GRPOConfig's: "
                              f"set GRPOConfig(epsilon=..., epsilon_high=...) with "
                              f"ParityOptions.from_recipe('bf16-engine')")
        return cls(**{**dict(engine_dtype=st["engine_dtype"], ratio_source=st["ratio_source"],
                             trainer_dtype=st["trainer_dtype"], recipe=name),
                      **overrides}).validate()


def _count_positions_as_the_engine(model: torch.nn.Module) -> None:
    """TRL's forwards pass no position ids, so transformers numbers a left-padded row from its
    padding, where the engine numbers it from its first token (`engines.positions`). With
    learned absolute positions (GPT-2) that scores another sequence than the one sampled, and
    the difference would be reported as precision gap β; every forward of the policy (and of
    the reference) gets the engine's position ids instead."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and mask is not None and not args:
            kwargs["position_ids"] = positions(mask)
        return args, kwargs
    model.register_forward_pre_hook(hook, with_kwargs=True)


def install_cpu_bf16(accelerator: Any) -> None:
    """On the CPU, the bf16 products `parity train` runs there (emulated where the CPU has no
    bf16 instructions: parity/cpu_bf16.py), said in one INFO line; accelerate, not parity,
    resolved the device."""
    if cpu_bf16.install_for(accelerator.device):
        logger.info("parity: %s", cpu_bf16.describe())


def install_cpu_fp16_scaler(accelerator: Any) -> None:
    """accelerate runs fp16 on CPU as plain fp32 with no scaler. With native_amp on, its
    autocast() turns fp16, and clip_grad_norm_ unscales before clipping; the scaler is the one
    AcceleratedOptimizer.step uses to skip overflowing steps."""
    if accelerator.scaler is None:
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler(
            accelerator.device.type, init_scale=FIELDS["loss_scale_init"].default,
            growth_interval=FIELDS["loss_scale_growth_interval"].default)


class ParityGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with parity's engine, ratio sources and diagnostics (module docstring)."""

    def __init__(self, *args: Any, parity: ParityOptions | None = None, **kwargs: Any):
        self.parity = (parity or ParityOptions()).validate()
        bound = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs)
        a = bound.arguments.get("args")
        if a is None:   # TRL's own default, made here so that it is adapted as a given one
            model = bound.arguments["model"]
            name = model if isinstance(model, str) else model.config._name_or_path
            a = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        trl_config.check_sampling(a)   # before TRL builds anything, vLLM included
        bound.arguments["args"] = trl_config.adapted(a, self.parity)
        with trl_vllm.parity_generation(self.parity.engine_dtype):
            super().__init__(*bound.args[1:], **bound.kwargs)
        install_cpu_bf16(self.accelerator)
        a = self.args
        if self.tools or self.rollout_func is not None:
            raise ParityError("ParityGRPOTrainer trains on one turn of text: tools and "
                              "rollout_func are not supported")
        self._positions = max_positions(self.accelerator.unwrap_model(self.model))
        self._check_prompts_fit()
        self.trainer_dtype = trl_config.trainer_dtype(a)
        self.guard = UpdateGuard(self, self.parity.max_consecutive_skips)
        self.add_callback(self.guard)
        self._emulated_checkpoints = self._fp16_emulation_under_checkpointing()
        master = self.accelerator.unwrap_model(self.model)
        # Whatever GRPOConfig(disable_dropout=...) says: dropout noise in the loss's forward
        # would be measured as precision gap.
        disable_dropout(master)
        _count_positions_as_the_engine(master)
        if getattr(self, "ref_model", None) is not None:
            disable_dropout(self.ref_model)
            _count_positions_as_the_engine(self.ref_model)
        # vLLM computes its head in engine precision, and the shadow is the engine's arithmetic.
        head32 = bool(a.cast_lm_head_to_fp32) and not self.use_vllm
        self.engine = (self._use_trls_vllm() if self.use_vllm
                       else self._make_engine(master, head32))
        self.generator = torch.Generator().manual_seed(a.seed + self.accelerator.process_index)
        self._synced_step: int | None = None
        # An fp32 engine against an fp32 trainer: the shadow forward is the trainer's own.
        self.shadow = None
        scored = self.parity.shadow_kernels == "scored"   # the engine scores, no copy here
        if not scored and not (self.parity.engine_dtype == "fp32" and
                               self.trainer_dtype == "fp32"):
            self.shadow = low_precision_copy(master, self.parity.engine_dtype, head32)
            if self.parity.shadow_kernels == "engine":  # else the trainer's own attention
                self.shadow.set_attn_implementation(ENGINE_ATTENTION)
            add_fused_lm_head(self.shadow, temperature=self.temperature,
                              cast_lm_head_to_fp32=head32)
        self._shadow_step: int | None = None
        self._loss_call: dict[str, torch.Tensor] | None = None
        self._routing = trl_routing.Tracker()
        if self.trainer_dtype == "fp16":
            install_cpu_fp16_scaler(self.accelerator)

    def _check_prompts_fit(self) -> None:
        """`parity train`'s check (`tasks.check_fits`) on every prompt of the datasets, as TRL
        tokenizes them, before any step: TRL itself would find out mid-training."""
        if self._positions is None:
            return
        named = {"train_dataset": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            named.update({f"eval_dataset[{k!r}]": v for k, v in self.eval_dataset.items()})
        else:
            named["eval_dataset"] = self.eval_dataset
        for name, ds in named.items():
            if not isinstance(ds, datasets.Dataset) or "prompt" not in ds.column_names:
                continue   # streamed: each batch is checked as it is sampled
            for a in range(0, len(ds), 512):
                ids, _, _ = self._tokenize_prompts(ds[a:a + 512]["prompt"])
                for i, x in enumerate(ids):
                    check_fits(f"{name} row {a + i}", len(x), "max_completion_length",
                               self.max_completion_length, self._positions)

    def _fp16_emulation_under_checkpointing(self) -> bool:
        """Whether the loss must recompute checkpointed layers under the fp16 emulation
        (`checkpoint_under_emulation`). Reentrant checkpointing has no hook to enter it, so
        there fp16 runs natively, with one warning."""
        a = self.args
        if not (self.trainer_dtype == "fp16" and self.accelerator.device.type == "cpu"
                and self.parity.cpu_fp16 == "emulate" and a.gradient_checkpointing):
            return False
        if (a.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            logger.warning("parity: fp16 emulation on CPU cannot run under reentrant gradient "
                           "checkpointing (gradient_checkpointing_kwargs use_reentrant=True): "
                           "fp16 runs natively instead, several times slower "
                           "(ParityOptions(cpu_fp16='native'))")
            self.parity = replace(self.parity, cpu_fp16="native")
            return False
        return True

    def _check_engine_sampling(self, engine: str) -> None:
        """An engine-scored shadow only where the engine scores what it samples; vLLM's order
        of min-p and top-p is not the one parity scores with."""
        s = self.sampling
        refuse_unable(engine, engine_needs(SimpleNamespace(
            lm_head_fp32=False, lora_merge=True, shadow_kernels=self.parity.shadow_kernels,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty)))

    def _use_trls_vllm(self) -> None:
        """TRL's vLLM samples (trl_vllm.py): its distribution is parity's `sampling`, its
        log-probs are refused unless they are ℓ_μ in the recipe's precision. No parity engine."""
        trl_vllm.check(self)
        vg = self.vllm_generation
        self.sampling, beyond = vg.sampling()
        if beyond:
            logger.warning("parity: TRL's vLLM samples with %s, which the trainer's log-probs "
                           "and parity's shadow do not apply: it enters every ratio and beta "
                           "(docs/trl.md)", ", ".join(beyond))
        self._check_engine_sampling(VLLM)
        vg.sync_through(os.path.join(self.args.output_dir, ".parity_weights"))

    def _make_engine(self, master: torch.nn.Module, head32: bool) -> Any:
        """The engine `ParityOptions.engine` names, behind the Engine interface."""
        a = self.args
        self.sampling = Sampling(self.temperature, a.top_p, a.top_k or 0, a.min_p or 0.0,
                                 a.repetition_penalty)
        generation = effective_config(master, self.generation_config)
        check_sampling(generation)
        warn_bypassed(bypassed(master, generation, self.sampling, self.max_completion_length))
        self._check_engine_sampling(self.parity.engine)
        check_engine(self.parity.engine, master.config)
        engine = make_engine(self.parity.engine, EngineSpec(
            master=master, model_dir=str(getattr(master, "name_or_path", "")),
            dtype=self.parity.engine_dtype, eos_ids=list(self.eos_token_ids),
            pad_id=self._tokenizer.pad_token_id, seed=a.seed + self.accelerator.process_index,
            max_len=a.vllm_max_model_length or master.config.max_position_embeddings,
            rows=a.generation_batch_size, cpu_fp16=self.parity.cpu_fp16, lm_head_fp32=head32))
        return engine

    # -- sampling --------------------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ParityError("ParityGRPOTrainer trains on text only (no images)")
        for ids in prompt_ids:   # a streamed dataset's prompts are first seen here
            check_fits("a prompt of this batch", len(ids), "max_completion_length",
                       self.max_completion_length, self._positions)
        if self.use_vllm:
            return self._trl_vllm_turn(prompt_ids, images, multimodal_fields, num_generations,
                                       has_tool_images)
        mode = "train" if self.model.training else "eval"
        if self._synced_step != self.state.global_step:
            changed = self.engine.sync(self.accelerator.unwrap_model(self.model))
            self._synced_step = self.state.global_step
            self._metrics[mode][mn.SYNC_CHANGED_FRAC].append(changed)
        r = self.engine.generate(prompt_ids, self.max_completion_length, self.sampling,
                                 self.generator)
        self._routing.note(r.routed, r.prompt_ids.shape[1])
        ids = r.completions()
        return ids, [r.engine_logprobs[i, :len(c)].tolist() for i, c in enumerate(ids)]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        routed = self._routing.batch(out["prompt_ids"], out["completion_ids"])
        if routed is not None:   # split and shuffled with the rest of TRL's batch
            out[trl_routing.ROUTED] = routed
        return out

    def _trl_vllm_turn(self, prompt_ids, *rest):
        """TRL's own vLLM turn; parity logs its sync, which TRL makes at each new step."""
        vg, master = self.vllm_generation, self.accelerator.unwrap_model(self.model)
        vg.attach_probe(master, prompt_ids)
        syncs = self._last_loaded_step != self.state.global_step
        out = super()._generate_single_turn(prompt_ids, *rest)
        if syncs:
            metrics = self._metrics["train" if self.model.training else "eval"]
            for k, v in vg.last.items():
                metrics[k].append(v)
            if mn.SYNC_CHANGED_FRAC not in vg.last and self.shadow is not None:
                # counted against the shadow's copy, cast at its last sync or loss call
                metrics[mn.SYNC_CHANGED_FRAC].append(cast_weights_into(master, self.shadow))
                self._shadow_step = self.state.global_step
        self._synced_step = self.state.global_step
        return out

    # -- the trainer's forward and the shadow's --------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        with fp16_kernels(self.trainer_dtype, self.accelerator.device, self.parity.cpu_fp16):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with fp16_kernels(self.trainer_dtype, self.accelerator.device, self.parity.cpu_fp16):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, *args, **kwargs):
        forward = (self._processed_logps if self.sampling.truncates or self.sampling.penalises
                   else super()._get_per_token_logps_and_entropies)
        call = self._loss_call
        own = call is not None and "pi" not in call and self._routing.loss is not None
        with (routing.recording(self.accelerator.unwrap_model(model)) if own
              else contextlib.nullcontext()) as rec:
            logps, entropies, aux = forward(model, input_ids, attention_mask, logits_to_keep,
                                            *args, **kwargs)
        if call is None or "pi" in call:  # not the loss's own forward (old, ref, eval)
            return logps, entropies, aux
        call["pi"] = logps.detach()
        if own:   # the trainer's own routing of the loss's tokens, in TRL's batch layout
            call["own"] = rec.pieces(input_ids.shape[1])
        if self.parity.diagnostics or self.parity.ratio_source == "shadow":
            call["s"] = self._shadow_logps(input_ids, attention_mask, logits_to_keep, logps)
            if self.parity.ratio_source == "shadow":
                # value ℓ_s, gradient ∇ℓ_π: TRL's exp(logps − ℓ_μ) becomes the shadow ratio
                logps = logps - logps.detach() + call["s"]
        return logps, entropies, aux

    def _processed_logps(self, model, input_ids, attention_mask, logits_to_keep,
                         batch_size=None, compute_entropy=False, compute_aux_loss=False, **_):
        """TRL's fused head scores log_softmax(logits / T) alone, where the engine drew from a
        truncated or penalised distribution: ℓ_π, ℓ_old and the reference's log-probs are taken
        under the engine's distribution too, from the whole vocabulary's logits."""
        n = batch_size or len(input_ids)
        parts = []
        for a in range(0, len(input_ids), n):
            ids, mask = input_ids[a:a + n], attention_mask[a:a + n]
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                            logits_to_keep=logits_to_keep + 1, **extra)
            parts.append((*token_logps(out.logits[:, :-1], ids, mask, self.sampling,
                                       compute_entropy), getattr(out, "aux_loss", None)))
        logps = torch.cat([p[0] for p in parts])
        entropies = torch.cat([p[1] for p in parts]) if compute_entropy else None
        aux = torch.stack([p[2] for p in parts]).mean() if compute_aux_loss else None
        return logps, entropies, aux

    @torch.no_grad()
    def _shadow_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      logits_to_keep: int, logp_pi: torch.Tensor) -> torch.Tensor:
        if self.parity.shadow_kernels == "scored" and self.engine is None:   # TRL's vLLM
            if self._last_loaded_step != self.state.global_step:  # it must hold these weights
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            return self.vllm_generation.score(input_ids, attention_mask,
                                              logits_to_keep).to(logp_pi.device)
        if self.parity.shadow_kernels == "scored":
            k = logits_to_keep
            r = Rollout(prompt_ids=input_ids[:, :-k], prompt_mask=attention_mask[:, :-k],
                        completion_ids=input_ids[:, -k:],
                        completion_mask=attention_mask[:, -k:].float(),
                        engine_logprobs=torch.zeros_like(logp_pi, dtype=torch.float32),
                        finished=torch.zeros(len(input_ids), dtype=torch.bool))
            return self.engine.score(self.accelerator.unwrap_model(self.model), r,
                                     self.sampling).to(logp_pi.device)
        if self.shadow is None:
            return logp_pi.detach()
        if self._shadow_step != self.state.global_step:  # weights move only at optimizer steps
            cast_weights_into(self.accelerator.unwrap_model(self.model), self.shadow,
                              count=False)
            self._shadow_step = self.state.global_step
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        dev = input_ids.device
        # Engine precision, whatever autocast the trainer's forward runs under, and the engine's
        # position ids. TRL passes none, so transformers would count a left-padded prompt's
        # padding, and in bf16 RoPE rounds differently at shifted positions: on SmolLM2-135M
        # that alone made |α| at θ = θ_old 0.043 per token, not 8e-6 (docs/trl.md).
        processed = self.sampling.truncates or self.sampling.penalises
        with torch.autocast(dev.type, enabled=False), \
                fp16_kernels(self.parity.engine_dtype, dev, self.parity.cpu_fp16):
            if processed:  # as the trainer's forward (`_processed_logps`)
                out = self.shadow(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=positions(attention_mask), use_cache=False,
                                  logits_to_keep=logits_to_keep + 1)
                return token_logps(out.logits[:, :-1], input_ids, attention_mask,
                                   self.sampling)[0]
            out = self.shadow(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=positions(attention_mask), labels=labels,
                              fused_lm_head=True)
        return out.log_probs[:, -logits_to_keep:].float()

    # -- the loss ---------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            self.guard.add_to(logs)
        super().log(logs, start_time)

    def _compute_loss(self, model, inputs):
        mu = inputs.get("sampling_per_token_logps")
        if mu is None:
            raise ParityError("no engine log-probs in the batch: the completions did not come "
                              "from parity's engine")
        if self.parity.ratio_source in ("engine", "shadow"):
            inputs = {**inputs, "old_per_token_logps": mu}
        if self._emulated_checkpoints:  # TRL re-enables checkpointing after each generation
            checkpoint_under_emulation(self.accelerator.unwrap_model(model),
                                       self.args.gradient_checkpointing_kwargs)
        self._loss_call = {}
        self._routing.loss = inputs.get(trl_routing.ROUTED)
        try:
            loss = super()._compute_loss(model, inputs)
            call = self._loss_call
        finally:
            self._loss_call, self._routing.loss = None, None
        mode = "train" if self.model.training else "eval"
        if mode == "train" and "pi" in call:
            self.guard.note("l_pi", call["pi"].where(inputs["completion_mask"] > 0, 0.0))
            self.guard.note("the loss", loss)
        if self.accelerator.scaler is not None:
            self._metrics[mode][mn.LOSS_SCALE].append(float(self.accelerator.scaler.get_scale()))
        if self.parity.diagnostics:
            for k, v in self._diagnose(inputs, call, mu).items():
                self._metrics[mode][k].append(v)
        return loss

    def _diagnose(self, inputs: dict, call: dict, mu: torch.Tensor) -> dict[str, float]:
        """docs/design.md's metrics for this micro-batch; `clipped` is what TRL's loss
        really clipped, recomputed from the log-ratio it used."""
        mask = inputs["completion_mask"].float()
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        clips = self.loss_type in CLIPPING_LOSSES
        eps = (self.epsilon_low, self.epsilon_high) if clips else (None, None)
        # Completions sampled at this optimizer step: θ = θ_old, so |α| is the kernel gap and
        # ℓ_π − ℓ_μ the mismatch before the policy moves. On completions reused by a later
        # step (num_iterations > 1, steps_per_generation) both include the policy change.
        fresh = self._synced_step == self.state.global_step
        diag, left_out, att = micro_batch_diagnostics(
            call["pi"], call["s"], mu, inputs.get("old_per_token_logps"), inputs["advantages"],
            mask, *eps, ratio_source=self.parity.ratio_source,
            sequence=self.importance_sampling_level == "sequence", first=fresh)
        self.guard.left_out(LeftOut.gathered(self.accelerator.gather(
            left_out.as_tensor(self.accelerator.device))))
        if self.accelerator.num_processes > 1:
            # Every rank's tokens, as one process holding them all would measure them: token
            # means weighted by each rank's tokens, maxima over all. TRL gathers its own figures
            # at this same call, on every rank.
            dist = Dist(self.accelerator.process_index, self.accelerator.num_processes,
                        self.accelerator.device)
            diag = StepDiagnostics.merge(dist.gather(diag))
        m = diag.metrics()
        if not fresh:
            m.pop(mn.KERNEL_GAP_ABS_MEAN, None)
        elif "own" in call:   # the routing compared where the weights are the sampled ones
            m.update(self._routing_figures(inputs, call, mu, mask, att))
        return m

    def _routing_figures(self, inputs: dict, call: dict, mu: torch.Tensor, mask: torch.Tensor,
                         att: Attribution) -> dict[str, float]:
        experts = routing.shape(self.accelerator.unwrap_model(self.model))[1]
        return trl_routing.figures(self.accelerator, inputs, call["own"], call["pi"], mu, mask,
                                   experts, att)


def micro_batch_diagnostics(pi: torch.Tensor, s: torch.Tensor, mu: torch.Tensor,
                            old: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor,
                            eps_low: float | None, eps_high: float | None, *,
                            ratio_source: str, sequence: bool, first: bool
                            ) -> tuple[StepDiagnostics, LeftOut, Attribution]:
    """parity's measurement of one TRL micro-batch on this rank (`GRPOTrainer._diagnose`; its
    figures are `.metrics()` once the ranks' parts are merged), its tokens left out for a
    log-prob NaN, inf or positive, and its per-token attribution. `old`: TRL's ℓ_old; None:
    the ratio is 1."""
    mask = mask.float().cpu()
    pi, s, mu = pi.float().cpu(), s.float().cpu(), mu.float().cpu()
    old = pi if old is None else old.float().cpu()
    mask, (pi, s, mu, old), left_out = usable_tokens(mask, pi, s, mu, old)
    pi, s, mu, old = pi * mask, s * mask, mu * mask, old * mask
    diag = StepDiagnostics()
    att = measure(diag, pi, s, mu, adv.float().cpu(), mask, eps_low, eps_high,
                  ratio_source=ratio_source, logp_old=old, sequence=sequence, first=first)
    return diag, left_out, att
