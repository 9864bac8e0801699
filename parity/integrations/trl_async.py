"""parity inside TRL's AsyncGRPOTrainer: the α/β diagnostics, the fixes, a CPU weight sync.

    from trl.experimental.async_grpo import AsyncGRPOConfig
    from parity.integrations.trl_async import ParityAsyncGRPOTrainer, AsyncParityOptions

    trainer = ParityAsyncGRPOTrainer(                 # instead of AsyncGRPOTrainer
        model="path/to/model", reward_funcs=[my_reward], train_dataset=dataset,
        args=AsyncGRPOConfig(output_dir="out", vllm_server_base_url="http://127.0.0.1:8000"),
        parity=AsyncParityOptions.from_recipe("bf16-shadow"))
    trainer.train()

AsyncGRPOTrainer samples over HTTP from a vLLM server and puts the server's log-probs ℓ_μ
straight into PPO's ratio as `old_log_probs`. The subclass leaves sampling, rewards,
advantages, packing, TRL's loss and logging to TRL, and changes four things:

- the weight sync: `DirectoryWeightTransfer` (parity/integrations/weight_sync.py) unless the
  caller passes another `weight_transfer`; each sync is checked against a probe;
- `compute_loss`: the shadow forward (the current weights in the server's dtype, on the same
  packed tree) gives ℓ_s, or with `scored_shadow` the server scores the update's sequences
  itself (it holds the loss's weights when it syncs every step), which leaves no kernel gap
  against its own kernels; the ratio source and the behaviour weights of parity's recipes are
  applied by rewriting TRL's inputs (`old_log_probs`, `advantages`) and the forward's value;
- the metrics: every clip attributed (docs/design.md) under parity's names beside TRL's;
- on CPU, TRL's tree attention (a CUDA flash-attention kernel) runs as a masked SDPA.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from parity import metric_names as mn
from parity.config import (
    FIELDS,
    Correction,
    CpuFp16,
    Dtype,
    RatioSource,
    check_fields,
    own,
    recipe,
    shared,
)
from parity.diagnostics import StepDiagnostics, measure
from parity.errors import ParityError
from parity.integrations import trl_config
from parity.integrations.trl import install_cpu_bf16, install_cpu_fp16_scaler
from parity.integrations.trl_updates import UpdateGuard
from parity.integrations.weight_sync import PROBE_TOLERANCE, DirectoryWeightTransfer, Server
from parity.models.forward import disable_dropout
from parity.models.loading import max_positions
from parity.models.precision import cast_weights_into, fp16_kernels, low_precision_copy
from parity.objectives import behaviour_weights
from parity.runs.finite import LeftOut, usable_tokens
from parity.tasks import check_fits

try:
    import trl
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async_module
    from trl.experimental.async_grpo import packing as trl_packing
    from trl.trainer.utils import add_fused_lm_head
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("parity.integrations.trl_async needs TRL >= 1.16: "
                      "pip install 'parity[trl]'") from e

TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


# -- TRL's tree attention on CPU -------------------------------------------------------------

def tree_mask(kv_index: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, n: int
              ) -> torch.Tensor:
    """[n, n] bool: packed query i may attend packed key j. Segment s's queries are the packed
    rows cu_q[s]:cu_q[s+1]; its keys the path kv_index[cu_k[s]:cu_k[s+1]] (root to the segment's
    end). As flash attention's causal mask with fewer queries than keys, query q of a segment
    sees the path up to its own position."""
    mask = torch.zeros(n, n, dtype=torch.bool, device=kv_index.device)
    for s in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        lq, lk = qb - qa, kb - ka
        keys = kv_index[ka:kb]
        allowed = (torch.arange(lk, device=mask.device)[None, :]
                   <= (lk - lq + torch.arange(lq, device=mask.device))[:, None])
        mask[qa:qb, keys] = allowed
    return mask


def cpu_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index,
                       tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q,
                       tree_max_seqlen_k, scaling=None, sliding_window=None, softcap=None,
                       **kwargs):
    """TRL's `tree_attention` off CUDA: the same attention pattern as one masked SDPA (exact in
    exact arithmetic; on CUDA TRL's flash-attention kernel runs unchanged)."""
    if query.is_cuda:
        return trl_packing.tree_attention(
            module, query, key, value, attention_mask, tree_kv_index=tree_kv_index,
            tree_cu_seqlens_q=tree_cu_seqlens_q, tree_cu_seqlens_k=tree_cu_seqlens_k,
            tree_max_seqlen_q=tree_max_seqlen_q, tree_max_seqlen_k=tree_max_seqlen_k,
            scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    if sliding_window or softcap:
        raise ParityError("parity's CPU tree attention has no sliding window or soft-capping")
    mask = tree_mask(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, query.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2), None


def use_cpu_tree_attention() -> None:
    """Register the CPU path under TRL's name; the models already say `tree_fa3`."""
    AttentionInterface.register(trl_packing.TREE_ATTENTION, cpu_tree_attention)


@contextlib.contextmanager
def _peak_flops_without_cuda() -> Iterator[None]:
    """While TRL's trainer is built: its __init__ asks CUDA for the device's name
    (`get_peak_flops_per_device`), which fails on CPU, where MFU is simply absent (TRL logs
    throughput without it). Only for that call: nothing of TRL is changed outside it."""
    trl_peak_flops = getattr(trl_async_module, "get_peak_flops_per_device", None)
    if trl_peak_flops is None:
        raise ParityError(f"ParityAsyncGRPOTrainer was written for TRL 1.16, whose "
                          f"AsyncGRPOTrainer computes MFU with get_peak_flops_per_device; TRL "
                          f"{getattr(trl, '__version__', '?')} has none: pip install trl==1.16.*")

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        return trl_peak_flops(accelerator, dtype) if accelerator.device.type == "cuda" else None
    trl_async_module.get_peak_flops_per_device = peak_flops
    try:
        yield
    finally:
        trl_async_module.get_peak_flops_per_device = trl_peak_flops


# -- flat loss terms as [completions, tokens] ------------------------------------------------

def rows(values: torch.Tensor, segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's flat loss terms (one per trained token, sample after sample, `segment` the sample
    index) as a right-padded [S, L] tensor and its mask: the layout parity's functions take."""
    counts = torch.bincount(segment)
    start = torch.cumsum(counts, 0) - counts
    col = torch.arange(segment.numel(), device=segment.device) - start[segment]
    out = values.new_zeros(counts.numel(), int(counts.max()))
    mask = torch.zeros(out.shape, dtype=torch.float32, device=values.device)
    out[segment, col] = values
    mask[segment, col] = 1.0
    return out, mask


def flat(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The inverse of `rows`: the valid entries in term order."""
    return x[mask > 0]


def packed_diagnostics(pi: torch.Tensor, s: torch.Tensor, old: torch.Tensor, mu: torch.Tensor,
                       adv: torch.Tensor, seg: torch.Tensor, eps_low: float | None,
                       eps_high: float | None, *, ratio_source: str
                       ) -> tuple[dict[str, float], LeftOut]:
    """docs/design.md's metrics of one AsyncGRPO micro-batch from its flat loss terms (ℓ_π, ℓ_s,
    ℓ_old, ℓ_μ and A per trained token, `seg` each term's sample), and its tokens left out for
    a log-prob NaN, inf or positive."""
    seg = seg.cpu()
    pi, mask = rows(pi.cpu(), seg)
    s, old, m, a = (rows(x.cpu(), seg)[0] for x in (s, old, mu, adv))
    mask, (pi, s, m, old), left_out = usable_tokens(mask, pi, s, m, old)
    d = StepDiagnostics()
    measure(d, pi, s, m, a, mask, eps_low, eps_high, ratio_source=ratio_source, logp_old=old)
    out = d.metrics()
    # α includes the policy's change over each sample's staleness, so it is no kernel gap
    # here; the sync's probe measures that (sync/probe_gap_abs_mean).
    out.pop(mn.KERNEL_GAP_ABS_MEAN, None)
    return out, left_out


def sequences(packed: dict[str, Any], index: torch.Tensor, seg: torch.Tensor
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Each sample of a packed tree row as its token ids (through its last trained token) and
    the positions in them of its trained tokens, term order: what an independent rescoring
    needs. A term predicts from packed position p; p lies in segment s, whose path (root to the
    segment's end) holds the context, and the target is the label at p."""
    ids, labels = packed["input_ids"][0].tolist(), packed["shift_labels"][0].tolist()
    cu_q, cu_k = packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist()
    kv = packed["tree_kv_index"].tolist()
    seqs: list[list[int]] = [[] for _ in range(int(seg.max()) + 1)]
    where: list[list[int]] = [[] for _ in seqs]
    for p, i in zip(index.tolist(), seg.tolist()):
        s = next(j for j in range(len(cu_q) - 1) if cu_q[j] <= p < cu_q[j + 1])
        path = kv[cu_k[s]:cu_k[s + 1]]
        k = len(path) - (cu_q[s + 1] - p)
        seqs[i] = [ids[x] for x in path[:k + 1]] + [labels[p]]
        where[i].append(k + 1)
    return seqs, where


# -- options ---------------------------------------------------------------------------------

@dataclass(kw_only=True)
class AsyncParityOptions:
    """What parity changes in AsyncGRPOTrainer; every other setting stays AsyncGRPOConfig's."""
    engine_dtype: Dtype | None = shared(
        "engine_dtype", default=None,
        help="The server's dtype these options expect (recipes set it): a server that serves "
             "another is refused. None: whatever it serves.")
    trainer_dtype: Dtype | None = shared(
        "trainer_dtype", default=None,
        help="The trainer precision these options expect (recipes set it); AsyncGRPOConfig's "
             "bf16/fp16 flags are set to it, one line saying which changed. None: whatever "
             "AsyncGRPOConfig says.")
    ratio_source: RatioSource = shared("ratio_source")
    correction: Correction = shared("correction")
    is_cap: float = shared("is_cap")
    geo_cap: float = shared("geo_cap")
    is_cap_low: float = shared("is_cap_low")
    diagnostics: bool = shared("diagnostics", help="Shadow forward on every loss call: alpha/beta "
                               "per token and each clip attributed. Off: none of parity's loss "
                               "metrics.")
    cpu_fp16: CpuFp16 = shared("cpu_fp16")
    lm_head_fp32: bool = shared("lm_head_fp32")
    max_consecutive_skips: int = shared("max_consecutive_skips")
    eps_low: float | None = shared("eps_low", default=None,
                                   help="Lower clip range; None: AsyncGRPOConfig.epsilon.")
    eps_high: float | None = shared("eps_high", default=None,
                                    help="Upper clip range; None: AsyncGRPOConfig's.")
    no_clip: bool = own(False, "No clipping at all (the no-clip recipe).")
    recipe: str | None = shared("recipe", default=None, help="The recipe these options come "
                                "from (from_recipe sets it), named where parity changes an "
                                "AsyncGRPOConfig setting for it.")
    weights_dir: str | None = own(None, "Directory the weight sync writes to, readable by the "
                                  "server. None: <output_dir>/.parity_weights.")
    keep_tokens: bool = own(False, "Keep every update's sequences and log-probs (l_mu, l_pi, l_s "
                            "per trained token) in trainer.parity_tokens, for checks and dumps.")
    scored_shadow: bool = own(False, "Let the server score the shadow (vLLM's prompt_logprobs of "
                              "each update's sequences) instead of a trainer-side forward in "
                              "its dtype: no kernel gap (docs/trl-async.md). Needs a sync every "
                              "step and sampling at T = 1 without truncation.")
    probe_tolerance: float = own(PROBE_TOLERANCE, "Largest mean |difference| per probe token "
                                 "between the server's log-probs and a forward of the synced "
                                 "weights in its dtype.", gt=0)

    def validate(self) -> AsyncParityOptions:
        check_fields(self)
        if self.correction != "none" and self.ratio_source != "recompute":
            raise ParityError(f"correction={self.correction!r} reweights by exp(l_old - l_mu) "
                              f"and needs ratio_source='recompute'")
        if self.lm_head_fp32:
            raise ParityError("lm_head_fp32: vLLM's server computes its head in its own dtype; "
                              "an fp32 head on one side only would widen the gap it is meant "
                              "to close")
        return self

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> AsyncParityOptions:
        """A recipe's ratio source, correction, clip range and the precisions it expects of
        the server and of AsyncGRPOConfig."""
        st = recipe(name, "the TRL trainers").settings
        clip = {}
        if st["eps_low"] is None:
            clip = dict(no_clip=True)
        # Config's own clip range is left to AsyncGRPOConfig's epsilon.
        elif (st["eps_low"], st["eps_high"]) != (FIELDS["eps_low"].default,
                                                 FIELDS["eps_high"].default):
            clip = dict(eps_low=st["eps_low"], eps_high=st["eps_high"])
        return cls(**{**dict(engine_dtype=st["engine_dtype"], trainer_dtype=st["trainer_dtype"],
                             ratio_source=st["ratio_source"], correction=st["correction"],
                             recipe=name, **clip), **overrides}).validate()


def _check_scored_shadow(args: Any) -> None:
    """The server can stand in for the shadow only where it holds the loss's weights and its
    scores are the sampling distribution's: vLLM's prompt_logprobs are the raw model's."""
    if args.weight_sync_steps != 1:
        raise ParityError(f"scored_shadow needs a weight sync every step (weight_sync_steps=1, "
                          f"not {args.weight_sync_steps}): the server must hold the weights "
                          f"the loss uses")
    if args.temperature != 1.0 or args.top_p != 1.0 or args.top_k not in (0, -1) or \
            args.min_p not in (None, 0.0) or args.repetition_penalty != 1.0:
        raise ParityError("scored_shadow needs sampling at temperature 1 with no top-p, top-k, "
                          "min-p or repetition penalty: the server scores a sequence with the "
                          "raw model, which is then not the distribution it sampled from")


# -- the trainer -----------------------------------------------------------------------------

def _packed(inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The forward's arguments for one rank's packed row, as AsyncGRPOTrainer.compute_loss
    builds them (inter-rank padding stripped)."""
    keep = inputs["attention_mask"].bool()
    out: dict[str, Any] = {k: inputs[k][keep].unsqueeze(0)
                           for k in ("input_ids", "position_ids", "shift_labels")}
    out.update({k: inputs[k][inputs[k] >= 0] for k in TREE_KEYS})
    out["tree_max_seqlen_q"], out["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    return out


def _probe_ids(tokenizer: Any, dataset: Any) -> list[int]:
    """The first training prompt, as the rollout worker renders it: the sync's fixed probe."""
    return _prompt_ids(tokenizer, dataset[0]["prompt"])


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """A training prompt's token ids, as the rollout worker renders it."""
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) \
        if isinstance(prompt, list) else prompt
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plain_response_template(tokenizer: Any) -> dict[str, Any]:
    """A transformers `response_template` that reads a whole completion as the assistant's
    text, up to the end-of-sequence token. AsyncGRPO's rollout worker parses every completion
    with one and knows templates of a few model families only; set this one
    (`tokenizer.response_template = plain_response_template(tokenizer)`) for any other model
    that calls no tools."""
    return {"defaults": {"role": "assistant"}, "start_anchor_pattern": r"",
            "fields": {"content": {"close_pattern": re.escape(tokenizer.eos_token) + r"\s*|$",
                                   "content": "text"}}}


class ParityAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's AsyncGRPOTrainer with parity's weight sync, ratio sources, behaviour weights and
    diagnostics (module docstring). Same arguments, plus `parity=AsyncParityOptions(...)`."""

    def __init__(self, model: str, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 parity: AsyncParityOptions | None = None, weight_transfer: Any = None,
                 **kwargs: Any):
        p = self.parity = (parity or AsyncParityOptions()).validate()
        if args is None:
            raise ParityError("ParityAsyncGRPOTrainer needs args=AsyncGRPOConfig(...) naming "
                              "the server (vllm_server_base_url)")
        self.engine_dtype = Server(args.vllm_server_base_url).dtype()
        if p.engine_dtype is not None and p.engine_dtype != self.engine_dtype:
            flag = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[p.engine_dtype]
            raise ParityError(f"these parity options expect a {p.engine_dtype} server but "
                              f"{args.vllm_server_base_url} serves {self.engine_dtype}: restart "
                              f"it with --dtype {flag}")
        trl_config.check_sampling(args)
        args = trl_config.adapted(args, p)
        self.trainer_dtype = trl_config.trainer_dtype(args)
        if self.trainer_dtype == "fp16" and p.cpu_fp16 == "emulate" and \
                args.gradient_checkpointing and (args.use_cpu or not torch.cuda.is_available()):
            raise ParityError("fp16 emulation on CPU cannot run under gradient checkpointing: "
                              "set AsyncGRPOConfig(gradient_checkpointing=False)")
        self.own_transfer = weight_transfer is None
        if self.own_transfer:
            weight_transfer = DirectoryWeightTransfer(
                args.vllm_server_base_url,
                p.weights_dir or os.path.join(args.output_dir, ".parity_weights"),
                timeout=args.weight_sync_timeout, tolerance=p.probe_tolerance)
        if p.scored_shadow:
            _check_scored_shadow(args)
        with _peak_flops_without_cuda():
            super().__init__(model, reward_funcs, args, *rest, weight_transfer=weight_transfer,
                             **kwargs)
        use_cpu_tree_attention()
        install_cpu_bf16(self.accelerator)
        self._check_prompts_fit()
        self.guard = UpdateGuard(self, p.max_consecutive_skips)
        self.add_callback(self.guard)
        self._setup_parity()
        if self.accelerator.is_main_process and self.rollout_worker is not None:
            self._watch_server(args.vllm_server_base_url)

    def _check_prompts_fit(self) -> None:
        """`parity train`'s check (`tasks.check_fits`) on every training prompt, before the
        rollout worker starts: TRL itself would find out mid-training."""
        limit = max_positions(self.accelerator.unwrap_model(self.model))
        ds = self.train_dataset
        if limit is None or not isinstance(ds, datasets.Dataset) or \
                "prompt" not in ds.column_names:
            return   # a streamed dataset's prompts are not known before the worker reads them
        for i, prompt in enumerate(ds["prompt"]):
            check_fits(f"train_dataset row {i}", len(_prompt_ids(self.processing_class, prompt)),
                       "max_completion_length", self.args.max_completion_length, limit)

    def _watch_server(self, url: str) -> None:
        """While the trainer waits for rollouts, TRL asks its worker for a heartbeat only; a
        dead server then shows as a worker that retries for minutes. Ask the server too."""
        worker, server = self.rollout_worker, Server(url, timeout=10)
        trl_check = worker.check_health

        def check_health(stale_after_s: float) -> None:
            server.call("GET", "/health", "the health check while waiting for rollouts")
            trl_check(stale_after_s)
        worker.check_health = check_health

    def _setup_parity(self) -> None:
        p = self.parity
        master = self.accelerator.unwrap_model(self.model)
        # Dropout noise in the loss's forward would be measured as precision gap.
        disable_dropout(master)
        if self.trainer_dtype == "fp16":
            install_cpu_fp16_scaler(self.accelerator)
        self.shadow = None   # an fp32 server against an fp32 trainer: ℓ_s is ℓ_π
        self.scorer = Server(self.args.vllm_server_base_url) if p.scored_shadow else None
        self._synced_step: int | None = None
        if self.scorer is None and not (self.engine_dtype == "fp32" and
                                        self.trainer_dtype == "fp32"):
            self.shadow = low_precision_copy(master, self.engine_dtype)
            add_fused_lm_head(self.shadow, temperature=self.temperature)
        self._shadow_step: int | None = None
        if self.own_transfer and self.accelerator.is_main_process:
            ref = low_precision_copy(master, self.engine_dtype)
            ref.set_attn_implementation("sdpa")
            self.weight_transfer.attach(ref, _probe_ids(self.processing_class,
                                                        self.train_dataset))
        if p.no_clip:
            self.epsilon_low, self.epsilon_high = 1.0, math.inf
        else:
            self.epsilon_low = p.eps_low if p.eps_low is not None else self.epsilon_low
            self.epsilon_high = p.eps_high if p.eps_high is not None else self.epsilon_high
        self._loss_call: dict[str, torch.Tensor] | None = None
        self.parity_tokens: list[dict[str, Any]] = []
        master.register_forward_hook(self._on_forward)

    # -- weights ----------------------------------------------------------------------------

    def _sync_weight(self) -> None:
        super()._sync_weight()
        self._synced_step = self.state.global_step   # the server now holds these weights
        if isinstance(self.weight_transfer, DirectoryWeightTransfer):
            for k, v in self.weight_transfer.last.items():
                self._metrics["train"][k].append(v)

    # -- the loss ---------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        with fp16_kernels(self.trainer_dtype, self.accelerator.device, self.parity.cpu_fp16):
            return super().training_step(model, inputs, num_items_in_batch)

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """The loss's own forward: keep ℓ_π; with the shadow ratio, its value becomes ℓ_s and
        its gradient stays ∇ℓ_π, so TRL's exp(log_probs − ℓ_μ) is the shadow ratio."""
        call = self._loss_call
        if call is None or "pi" in call or getattr(output, "log_probs", None) is None:
            return output
        lp = output.log_probs
        call["pi"] = lp.detach().flatten().float()
        if "s_at" in call:      # the server scored the trained tokens only
            call["s"] = call["pi"].clone()
            call["s"][call["s_index"]] = call.pop("s_at").to(call["s"])
        if self.parity.ratio_source == "shadow" and "s" in call:
            output.log_probs = lp + (call["s"].to(lp.dtype).view_as(lp) - lp).detach()
        return output

    @torch.no_grad()
    def _shadow_logps(self, packed: dict[str, Any]) -> torch.Tensor:
        if self._shadow_step != self.state.global_step:   # weights move at optimizer steps
            cast_weights_into(self.accelerator.unwrap_model(self.model), self.shadow,
                              count=False)
            self._shadow_step = self.state.global_step
        dev = packed["input_ids"].device
        with torch.autocast(dev.type, enabled=False), \
                fp16_kernels(self.engine_dtype, dev, self.parity.cpu_fp16):
            out = self.shadow(**packed, fused_lm_head=True)
        return out.log_probs.flatten().float()

    def _scored_logps(self, packed: dict[str, Any], index: torch.Tensor, seg: torch.Tensor
                      ) -> torch.Tensor:
        """ℓ_s of each trained token (term order) as the server scores it: it holds this
        optimizer step's weights, synced at the end of the last one."""
        if self._synced_step != self.state.global_step:
            raise ParityError(f"scored_shadow: the server holds the weights of step "
                              f"{self._synced_step}, the trainer is at step "
                              f"{self.state.global_step}; it needs a sync every step")
        seqs, where = sequences(packed, index.cpu(), seg.cpu())
        scored = self.scorer.score(seqs, "the shadow's scoring request")
        nth = [0] * len(seqs)
        out = torch.empty(index.numel(), dtype=torch.float64)
        for t, i in enumerate(seg.tolist()):     # term t is sample i's nth[i]-th trained token
            out[t] = scored[i][where[i][nth[i]] - 1]
            nth[i] += 1
        return out.to(index.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        p = self.parity
        sel = inputs["token_index"] >= 0
        packed = _packed(inputs)
        index, seg = inputs["token_index"][sel], inputs["segment_id"][sel]
        mu, adv = inputs["old_log_probs"][sel].float(), inputs["advantages"][sel].float()
        inputs, call, stats = dict(inputs), {}, {}
        t0 = time.perf_counter()
        if self.scorer is not None and (p.diagnostics or p.ratio_source == "shadow"):
            call["s_at"], call["s_index"] = self._scored_logps(packed, index, seg), index
        elif self.shadow is not None and (p.diagnostics or p.ratio_source == "shadow"):
            call["s"] = self._shadow_logps(packed)
        shadow_s = time.perf_counter() - t0
        if p.ratio_source == "recompute":
            # ℓ_old at the weights of this optimizer step, before it updates them (decoupled
            # PPO); TRL's ratio becomes exp(ℓ_π − ℓ_old), the weights w multiply A.
            with torch.no_grad():
                old = model(**packed, fused_lm_head=True).log_probs.flatten().float()[index]
            call["old"] = old
            inputs["old_log_probs"] = inputs["old_log_probs"].clone()
            inputs["old_log_probs"][sel] = old.to(inputs["old_log_probs"].dtype)
            if p.correction != "none":
                o, m = rows(old.double(), seg)
                w, stats = behaviour_weights(o, rows(mu.double(), seg)[0], m, p.correction,
                                             p.is_cap, p.geo_cap, p.is_cap_low)
                inputs["advantages"] = inputs["advantages"].clone()
                inputs["advantages"][sel] = (adv * flat(w, m)).to(inputs["advantages"].dtype)
        self._loss_call = call
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._loss_call = None
        if "pi" in call:
            self.guard.note("l_pi", call["pi"][index])
            self.guard.note("the loss", loss)
        metrics = self._metrics["train"]
        if "s" in call:
            metrics[mn.SHADOW_S].append(shadow_s)
        if self.accelerator.scaler is not None:
            metrics[mn.LOSS_SCALE].append(float(self.accelerator.scaler.get_scale()))
        for k, v in stats.items():
            metrics[k].append(v)
        if p.diagnostics and "pi" in call:
            for k, v in self.diagnose(call, index, seg, mu, adv).items():
                metrics[k].append(v)
        if p.keep_tokens and "pi" in call:
            self._keep(packed, call, index, seg, mu)
        return loss

    def _keep(self, packed: dict[str, Any], call: dict[str, torch.Tensor], index: torch.Tensor,
              seg: torch.Tensor, mu: torch.Tensor) -> None:
        seqs, where = sequences(packed, index.cpu(), seg.cpu())
        pi = call["pi"][index].cpu()
        s = call["s"][index].cpu() if "s" in call else pi

        def per_sample(x: torch.Tensor) -> list[list[float]]:
            return [x[seg.cpu() == i].tolist() for i in range(len(seqs))]
        self.parity_tokens.append({"step": self.state.global_step + 1, "sequences": seqs,
                                   "positions": where, "logp_mu": per_sample(mu.cpu()),
                                   "logp_pi": per_sample(pi), "logp_s": per_sample(s)})

    def diagnose(self, call: dict[str, torch.Tensor], index: torch.Tensor, seg: torch.Tensor,
                 mu: torch.Tensor, adv: torch.Tensor) -> dict[str, float]:
        """docs/design.md's metrics for one micro-batch; `clipped` recomputed from the log-ratio
        TRL's loss really used."""
        src = self.parity.ratio_source
        pi = call["pi"][index]
        eps = (None, None) if self.parity.no_clip else (self.epsilon_low, self.epsilon_high)
        out, left_out = packed_diagnostics(
            pi, call["s"][index] if "s" in call else pi, call["old"] if src == "recompute"
            else mu, mu, adv, seg, *eps, ratio_source=src)
        self.guard.left_out(left_out)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.guard.add_to(logs)
        m = self._metrics["train"]
        for ours, trls in (("staleness/mean", "sample/staleness_mean"),
                           ("staleness/max", "sample/staleness_max")):
            if m.get(trls):
                m[ours] = list(m[trls])
        super().log(logs, start_time)
