"""ParityGRPOTrainer on TRL's own vLLM (`GRPOConfig(use_vllm=True)`), colocated or a server.

TRL samples and syncs its vLLM as usual, and keeps vLLM's log-prob of each sampled token as
`sampling_per_token_logps`: that is ℓ_μ. parity checks that vLLM gives the log-prob under the
distribution it sampled from (`logprobs_mode="processed_logprobs"`: TRL's colocated LLM is
started so, and `trl vllm-serve` starts a server so), that it serves the engine precision the
recipe names, and that the ratio TRL will use is the recipe's. Around it parity adds what it
adds to any engine: the shadow (the current weights cast to engine precision, trainer-side, or
scored by this very vLLM with `shadow_kernels="scored"`), the ratio sources and the metrics.

What parity sets or replaces in TRL's vLLM, each because TRL offers no setting or no path:

- colocate: TRL starts `LLM(...)` without a dtype, so vLLM would serve the checkpoint's (an fp32
  checkpoint in bf16); parity passes `engine_dtype`. On the CPU it also runs vLLM eager (graph
  compilation made each start 34.6 s against 2.4 s on the testbed; docs/trl.md), sizes the KV
  cache for the batch (TRL's `vllm_gpu_memory_utilization` would ask for a share of the
  machine's memory unless VLLM_CPU_KVCACHE_SPACE is set) and keeps the trainer's thread count.
- without CUDA, the weight sync. Colocated, TRL calls the model's `load_weights`, which no
  longer reaches the CPU backend's repacked linear layers: parity reloads the weights in place
  (`reload_weights`, as parity's own vLLM engine does). Against a server TRL streams over NCCL,
  which needs CUDA: parity writes them to a directory the server reloads from
  (`DirectoryWeightTransfer`, checked against a probe at every sync; docs/trl.md).
On CUDA both syncs stay TRL's.
"""

from __future__ import annotations

# Imports inside functions: vllm is optional; it loads when TRL's vLLM is used.
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from parity.errors import ParityError
from parity.integrations.weight_sync import DirectoryWeightTransfer, Server
from parity.logprobs import TOP_TOKEN_ONLY, Sampling
from parity.models.precision import low_precision_copy
from parity.models.sizes import kv_cache_bytes

try:
    from trl.generation import vllm_generation as trl_vllm_generation
    from trl.generation.vllm_generation import VLLMClient, VLLMGeneration
    from trl.trainer import grpo_trainer as trl_grpo
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("parity.integrations.trl_vllm needs TRL: pip install 'parity[trl]'") from e

FLAG = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_OF = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
            "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# SamplingParams that TRL's generation_kwargs may set without changing the distribution a token
# is drawn from.
NEUTRAL = frozenset({"seed", "n", "max_tokens", "logprobs", "stop", "stop_token_ids",
                     "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"})
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@contextlib.contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def parity_generation(engine_dtype: str) -> Iterator[None]:
    """While GRPOTrainer.__init__ runs: TRL's vLLM backend is `ParityVLLMGeneration`."""
    def build(**kw: Any) -> ParityVLLMGeneration:
        return ParityVLLMGeneration(engine_dtype=engine_dtype, **kw)
    with _replaced(trl_grpo, "VLLMGeneration", build):
        yield


def _colocated_llm(engine_dtype: str, cpu: bool) -> Any:
    """vLLM's LLM as TRL starts it, in engine precision (module docstring)."""
    from vllm import LLM


    def build(*args: Any, **kw: Any) -> Any:
        kw.setdefault("dtype", FLAG[engine_dtype])
        kw["logprobs_mode"] = "processed_logprobs"   # TRL's own choice, whatever TRL becomes
        if cpu:   # GRPOConfig has no setting for it (module docstring)
            kw.setdefault("enforce_eager", True)
        if cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(kw["model"],
                                                trust_remote_code=kw.get("trust_remote_code"))
            length = kw.get("max_model_len") or config.max_position_embeddings
            kw.setdefault("kv_cache_memory_bytes", kv_cache_bytes(
                config, engine_dtype, kw.get("max_num_seqs") or 16, length))
        # vLLM's CPU worker makes torch.set_num_threads a no-op for the whole process.
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            return LLM(*args, **kw)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
    return build


class ParityVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend with the settings and syncs of the module docstring, and `score`."""

    def __init__(self, *, engine_dtype: str, **kw: Any):
        if kw.get("top_p") == 0:   # vLLM refuses 0; this keeps the likeliest token alone too
            kw["top_p"] = TOP_TOKEN_ONLY
        self.engine_dtype = engine_dtype
        self.transfer: DirectoryWeightTransfer | None = None
        self.last: dict[str, float] = {}
        super().__init__(**kw)

    @property
    def cuda(self) -> bool:
        return self.accelerator.device.type == "cuda"

    @property
    def url(self) -> str:
        return self.server_base_url or f"http://{self.server_host}:{self.server_port}"

    def _init_vllm(self) -> None:
        if self.mode == "colocate":
            cpu = self.accelerator.device.type == "cpu"
            with _replaced(trl_vllm_generation, "LLM", _colocated_llm(self.engine_dtype, cpu)):
                super()._init_vllm()
        elif self.mode == "server" and not self.cuda:
            # TRL's server branch, less the NCCL communicator it cannot open here.
            if self.accelerator.is_main_process:
                self.vllm_client = VLLMClient(base_url=self.url, group_port=self.group_port,
                                              connection_timeout=self.server_timeout)
            self.accelerator.wait_for_everyone()
        else:
            super()._init_vllm()

    # -- what it serves ---------------------------------------------------------------------

    def served(self) -> tuple[str, str]:
        """(engine precision, logprobs_mode) of the vLLM that samples."""
        if self.mode == "colocate":
            mc = self.llm.llm_engine.model_config
            return DTYPE_OF.get(str(mc.dtype), str(mc.dtype)), str(mc.logprobs_mode)
        mc = Server(self.url, timeout=60).model_config()
        return DTYPE_OF.get(mc["dtype"], mc["dtype"]), str(mc.get("logprobs_mode"))

    def sampling(self) -> tuple[Sampling, list[str]]:
        """The distribution TRL's SamplingParams draw from, as parity's `Sampling`, and the
        settings beyond it that parity's log-probs do not apply."""
        kw = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
              "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
              **{k: v for k, v in self.generation_kwargs.items() if k in SAMPLING_KEYS}}
        top_k = int(kw["top_k"] or 0)
        s = Sampling(float(kw["temperature"]), 1.0 if kw["top_p"] is None else float(kw["top_p"]),
                     max(top_k, 0),
                     float(kw["min_p"] or 0.0), float(kw["repetition_penalty"] or 1.0))
        other = sorted(f"{k}={v!r}" for k, v in self.generation_kwargs.items()
                       if k not in SAMPLING_KEYS and k not in NEUTRAL)
        if self.structured_outputs_regex is not None:
            other.append("vllm_structured_outputs_regex")
        return s, other

    # -- weights ----------------------------------------------------------------------------

    def sync_weights(self) -> None:
        if self.cuda:
            return super().sync_weights()
        if self.mode == "colocate":
            dt = self.llm.llm_engine.model_config.dtype
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (
                (n, t.detach().to(dt)) for n, t in self._iter_named_params())})
            self.llm.reset_prefix_cache()
            return
        params = list(self._iter_named_params())   # every rank takes part in the gathers
        if self.transfer is None:                  # not the main process
            return
        self.transfer.pause()
        self.transfer.send_weights(params)
        self.transfer.resume()
        self.vllm_client.reset_prefix_cache()
        self.last = dict(self.transfer.last)

    def sync_through(self, directory: str) -> None:
        """A server without CUDA on the trainer's side: weights go through `directory`."""
        if self.mode == "server" and not self.cuda and self.accelerator.is_main_process:
            self.transfer = DirectoryWeightTransfer(self.url, directory,
                                                    timeout=self.server_timeout)

    def attach_probe(self, master: torch.nn.Module, prompt_ids: list[list[int]]) -> None:
        """The directory sync's check: the longest prompt of the first batch, against a copy
        of the policy in the server's precision."""
        if self.transfer is None or self.transfer.reference is not None:
            return
        ref = low_precision_copy(master, self.engine_dtype)
        ref.set_attn_implementation("sdpa")
        self.transfer.attach(ref, max(prompt_ids, key=len))

    # -- the scored shadow ------------------------------------------------------------------

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int
              ) -> torch.Tensor:
        """ℓ of the last `k` tokens of each row, [B, k], as this vLLM computes them on the
        weights it holds (prompt log-probs, T = 1); 0 on padding."""
        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        comp = [int(m.sum()) for m in attention_mask[:, -k:]]
        out = torch.zeros((len(rows), k), dtype=torch.float32)
        if self.mode == "colocate":
            from vllm import SamplingParams
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0,
                                    detokenize=False)
            outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params,
                                     use_tqdm=False)
            for i, (o, r, c) in enumerate(zip(outs, rows, comp)):
                steps = o.prompt_logprobs[len(r) - c:]
                out[i, :c] = torch.tensor([float(st[t].logprob)
                                           for st, t in zip(steps, r[len(r) - c:])])
        else:
            scored = Server(self.url, timeout=self.server_timeout).score(
                rows, "the shadow's scoring request")
            for i, (lp, c) in enumerate(zip(scored, comp)):
                out[i, :c] = lp[len(lp) - c:].float()
        return out.to(input_ids.device)

    def close(self) -> None:
        """Stop a colocated engine's core (TRL keeps it for the process's life)."""
        core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None),
                       "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


# -- the checks, once TRL has built its vLLM ---------------------------------------------------

def check(trainer: Any) -> None:
    """Refuse, one line each, what would make ℓ_μ other than parity's recipe says: raw
    log-probs, another precision."""
    p, a, vg = trainer.parity, trainer.args, trainer.vllm_generation
    if not isinstance(vg, ParityVLLMGeneration):
        raise ParityError("ParityGRPOTrainer found another vLLM backend than its own")
    dtype, mode = vg.served()
    where = ("TRL's colocated vLLM" if a.vllm_mode == "colocate"
             else f"the vLLM server at {vg.url}")
    if dtype != p.engine_dtype:
        fix = (f"restart it with --dtype {FLAG[p.engine_dtype]}" if a.vllm_mode == "server"
               else f"ParityOptions(engine_dtype={dtype!r})")
        raise ParityError(f"these parity options expect a {p.engine_dtype} engine but {where} "
                          f"serves {dtype}: {fix}")
    if mode != "processed_logprobs":
        # Colocated, parity starts vLLM with processed log-probs itself (GRPOConfig has no
        # setting for it); a server is started by the user.
        raise ParityError(f"{where} returns {mode}, not the log-probs of the distribution it "
                          f"sampled from (temperature, top-k, top-p applied): restart it with "
                          f"--logprobs-mode processed_logprobs (trl vllm-serve sets it)")
