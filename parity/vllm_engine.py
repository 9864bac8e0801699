"""The `vllm` engine: vLLM in engine precision on a CUDA GPU (`pip install 'parity[vllm]'`).

UNVERIFIED: this module has never run against vLLM (the one GPU machine lent so far could not
carry vLLM). What is tested (tests/test_vllm_engine.py) is the part that needs no vLLM: the
sampling settings it passes and how it turns vLLM's outputs into a Rollout; and that asking for
it without vLLM or without a GPU is a clear error. docs/scaling.md says the same.

ℓ_μ must be the log-prob under the distribution actually sampled from. vLLM returns the raw
model's log-probs unless it is started with `logprobs_mode="processed_logprobs"`: then they are
taken after temperature, top-k and top-p, renormalised over the kept tokens, as parity's
`logprobs_from_logits` scores them (TRL starts vLLM the same way for its importance weights).

Weights: the trainer's fp32 master weights are cast into an engine-precision copy on the CPU
(which also gives `sync/changed_frac` and the checkpoint's engine weights) and loaded into
vLLM's model in place with its `load_weights`, the way TRL's colocate mode reaches it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from parity.engines import Rollout, Sampling, Shard, left_pad
from parity.errors import ParityError, one_line
from parity.precision import cast_weights_into, low_precision_copy

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def check_available() -> None:
    """Refuse engine=vllm before the run directory is made, in one line."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ParityError("engine=vllm needs vLLM: pip install 'parity[vllm]' on a machine "
                          "with a CUDA GPU (or use engine=hf)") from None
    if not torch.cuda.is_available():
        raise ParityError("engine=vllm runs on a CUDA GPU and this machine has none; use "
                          "engine=hf")


def sampling_kwargs(s: Sampling, max_new_tokens: int, eos_ids: list[int], seed: int
                    ) -> dict[str, Any]:
    """vLLM SamplingParams for one completion per prompt, with the sampled token's log-prob."""
    return dict(n=1, temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1, min_p=0.0, max_tokens=max_new_tokens,
                logprobs=0, seed=seed, stop_token_ids=list(eos_ids), ignore_eos=False,
                detokenize=False, skip_special_tokens=False)


def row_seeds(base: int, rows: list[int]) -> list[int]:
    """One vLLM seed per completion, from the step's base seed and the row's place in the whole
    batch: distinct within the batch, and the same whichever rank samples the row."""
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
    for i, (c, l) in enumerate(zip(completions, logprobs)):
        if len(c) != len(l):
            raise ValueError(f"completion {i}: {len(c)} tokens but {len(l)} log-probs")
        comp[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        valid[i, :len(c)] = 1.0
        lp[i, :len(c)] = torch.tensor(l, dtype=torch.float32)
    return Rollout(ids, mask, comp, valid, lp, torch.tensor(finished, dtype=torch.bool))


class VLLMEngine:
    """The HFEngine's interface (`sync`, `generate`, `model`, `version`) on vLLM."""

    def __init__(self, master: torch.nn.Module, model_dir: str, dtype: str,
                 eos_ids: list[int], pad_id: int, gpu_memory: float, seed: int):
        check_available()
        from vllm import LLM
        self.dtype, self.eos_ids, self.pad_id, self.version = dtype, eos_ids, pad_id, 0
        # The engine-precision copy: what vLLM is given at each sync, kept for changed_frac.
        self.model = low_precision_copy(master, dtype)
        # In-process engine core, so the driver worker's model is reachable for load_weights.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kw: dict[str, Any] = {}
        if torch.distributed.is_initialized():
            kw["distributed_executor_backend"] = "external_launcher"  # one vLLM per rank
        try:
            self.llm = LLM(model=model_dir, dtype=VLLM_DTYPES[dtype], seed=seed,
                           logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory,
                           enable_prefix_caching=False, **kw)
        except Exception as e:
            raise ParityError(f"vLLM could not start on {model_dir}: {one_line(e)}") from None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _vllm_model(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    @torch.no_grad()
    def sync(self, master: torch.nn.Module) -> float:
        self.version += 1
        changed = cast_weights_into(master, self.model)
        device = torch.device("cuda")
        self._vllm_model().load_weights([(name, t.to(device))
                                         for name, t in self.model.state_dict().items()])
        self.llm.reset_prefix_cache()
        return changed

    def generate(self, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
                 generator: torch.Generator, record_rows: list[int] | None = None,
                 shard: Shard | None = None) -> Rollout:
        """One completion per prompt. vLLM keeps no whole distributions: `record_rows` is
        ignored and the exact KL is not reported with this engine."""
        from vllm import SamplingParams
        # vLLM seeds each request on its own: the copies of a prompt need different seeds, or
        # a GRPO group would be G copies of one completion. Row ids of the whole batch make the
        # seeds independent of how the batch is split over ranks.
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        seeds = row_seeds(base, shard.rows if shard else list(range(len(prompts))))
        params = [SamplingParams(**sampling_kwargs(s, max_new_tokens, self.eos_ids, seed))
                  for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        comps, lps, done = [], [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            comps.append(ids)
            lps.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids)])
            done.append(c.finish_reason == "stop")
        # Built on the host from vLLM's lists; the trainer's tensors live on its device.
        return rollout_from_outputs(prompts, comps, lps, done, self.pad_id,
                                    shard.width if shard else 0).to(self.device)
