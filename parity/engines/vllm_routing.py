"""The experts vLLM chose, read in its own process, for `Rollout.routed` (parity/models/routing.py's
layout: [B, P + T, L, k], the unknown mark where no forward fed a position).

vLLM returns its routing as `CompletionOutput.routed_experts` only through its AuxOutput
connector, which needs Model Runner V2, which needs Triton: the CPU build cannot start it
(docs/moe.md). The capture point that connector reads is there on every build, though: each MoE
layer's router (`BaseRouter.set_capture_fn`) hands it the logical expert ids [tokens, k] it
chose, before any expert-parallel remapping. `RouteRecorder` sets that callback and maps each
forward's token rows back to requests and positions through the model runner's batch
(`input_batch.req_ids`, `req_indices`, `positions`), as vLLM's own capturer does. Private vLLM
interfaces, from 0.32; `tests/test_vllm_routing.py` holds them to parity's engine's record.
"""

from __future__ import annotations

# Imports inside functions: vllm is optional (README.md's vLLM command); `install` runs in its
# worker, where it is loaded.
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import numpy as np
import torch

from parity.models.routing import id_dtype, unknown

ROUTE = "parity_route"   # SamplingParams.extra_args key of a request whose routing is kept


class RouteRecorder:
    """Per marked request, the experts of every position vLLM fed through its MoE layers."""

    def __init__(self, runner: Any, routers: list[tuple[int, Any]], experts: int, top_k: int):
        self.runner, self.experts, self.top_k = runner, experts, top_k
        self.layers = [layer for layer, _ in routers]
        self.on = False
        # per forward: (request keys, each token row's request, positions, ids [N, L, k])
        self._forwards: list[tuple[list[str | None], np.ndarray, np.ndarray, torch.Tensor]] = []
        for j, (_, router) in enumerate(routers):
            router.set_capture_fn(partial(self._capture, j))

    def _capture(self, j: int, topk_ids: torch.Tensor) -> None:
        if not self.on:
            return
        if j == 0:   # the first MoE layer of a forward: the batch the runner laid out for it
            self._begin()
        ids = self._forwards[-1][3]
        n = min(len(ids), topk_ids.shape[0])
        ids[:n, j] = topk_ids[:n].to(ids.dtype)

    def _begin(self) -> None:
        runner = self.runner
        reqs = list(runner.input_batch.req_ids)
        total = int(runner.query_start_loc.np[len(reqs)])
        keys = []
        for rid in reqs:
            extra = getattr(getattr(runner.requests.get(rid), "sampling_params", None),
                            "extra_args", None)
            keys.append(extra.get(ROUTE) if extra else None)
        rows = runner.req_indices.np[:total].copy()
        pos = runner.positions[:total].cpu().numpy().copy()
        ids = torch.full((total, len(self.layers), self.top_k), unknown(self.experts),
                         dtype=id_dtype(self.experts))
        self._forwards.append((keys, rows, pos, ids))

    def clear(self) -> None:
        self._forwards.clear()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The forwards inside are kept (what an earlier call left is dropped)."""
        self.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def take(self, prompt_lens: list[int], width: int, total: int) -> torch.Tensor:
        """[B, width + total, L, k] for the requests marked "0" to "B-1" (B prompts), in the
        layout of a rollout whose prompts are left-padded to `width`: position p of a prompt
        of length n is column p + width - n, for the prompt and the completion alike."""
        out = torch.full((len(prompt_lens), width + total, len(self.layers), self.top_k),
                         unknown(self.experts), dtype=id_dtype(self.experts))
        where = {str(i): i for i in range(len(prompt_lens))}
        lens = np.asarray(prompt_lens, dtype=np.int64)
        for fkeys, rows, pos, ids in self._forwards:   # one scatter per forward
            to_row = np.array([where.get(k, -1) for k in fkeys] + [-1], dtype=np.int64)
            i = to_row[rows]
            cols = pos + width - lens[np.maximum(i, 0)]
            keep = (i >= 0) & (cols >= 0) & (cols < width + total)
            out[torch.from_numpy(i[keep]), torch.from_numpy(cols[keep])] = \
                ids[torch.from_numpy(np.nonzero(keep)[0])]
        self.clear()
        return out


def install(worker: Any) -> RouteRecorder | None:
    """Runs on vLLM's worker (collective_rpc): a RouteRecorder on the model's MoE routers, or
    None for a dense model or a runner without the batch layout it reads."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if not all(hasattr(runner, a) for a in ("input_batch", "requests", "query_start_loc",
                                             "req_indices", "positions")):
        return None
    model = runner.get_model()
    found = sorted(((m.layer_id, m.router) for m in model.modules()
                    if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)),
                   key=lambda t: t[0])
    if not found:
        return None
    router = found[0][1]
    return RouteRecorder(runner, found, router.global_num_experts, router.top_k)
