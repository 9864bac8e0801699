"""Weight sync for TRL's AsyncGRPOTrainer without CUDA: safetensors through a shared directory.

TRL's own transfer streams the weights over NCCL, which needs CUDA on both sides. vLLM's server
in development mode (`VLLM_SERVER_DEV_MODE=1`) offers what this one needs instead:

1. `POST /pause?mode=keep` freezes in-flight requests;
2. the trainer writes its weights, cast to the server's dtype, as one safetensors file into a
   fresh directory (`<dir>/v<N>/model.safetensors`, published by an atomic rename);
3. `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}` makes
   every worker reload its model in place from that directory (the same `reload_weights` the
   in-process engine uses, reading from disk instead of an iterator);
4. `POST /update_weight_version` tags the server with the sync's number, `POST /resume`;
5. the check: the server's log-probs of a fixed probe are compared with a forward of the
   trainer's weights in the server's dtype. They must agree to within the kernel gap, and they
   must differ from the previous sync's whenever the weights the probe sees changed.

Why a directory: `/collective_rpc` passes strings only, so weights cannot travel in the request;
a registered transfer engine (`WeightTransferEngineFactory.register_engine`) would have to be
installed into the server's process as a plugin, and the built-in "ipc" engine shares CUDA
memory. A path works wherever the server can read what the trainer writes: the same machine
(a tmpfs such as /dev/shm avoids the disk), or two machines sharing a filesystem. docs/trl-async.md
gives the measured cost.

Any failure (the server unreachable, not in development mode, a refused reload, a probe that
shows other or unchanged weights) raises ParityError: training stops with one line and never
goes on against stale weights.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from parity import metric_names as mn
from parity.engines.server import field, request
from parity.errors import ParityError, one_line
from parity.files import write_failure
from parity.models.precision import fp16_kernels

SERVER_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Server:
    """The few HTTP calls to a vLLM server this needs, each failure one ParityError line."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._model: str | None = None

    def call(self, method: str, path: str, what: str, timeout: float | None = None,
             params: dict[str, str] | None = None, json: Any = None) -> Any:
        """The answer's JSON (None for an empty body), through parity's one HTTP client."""
        reply = request(method, self.url + path, self.where(path, what),
                        self.timeout if timeout is None else timeout, json, params)
        if reply.status == 404 and path != "/v1/completions":
            raise ParityError(f"vLLM server at {self.url} has no {path} ({what}): start it with "
                              f"VLLM_SERVER_DEV_MODE=1 in its environment")
        if reply.status != 200:
            raise ParityError(f"vLLM server at {self.url} refused {what} (HTTP {reply.status}): "
                              f"{reply.error_text()}")
        return reply.json() if reply.body.strip() else None

    def where(self, path: str, what: str) -> str:
        return f"vLLM server at {self.url}{path} ({what})"

    def model_config(self) -> dict[str, Any]:
        """`/server_info`'s `vllm_config.model_config` (development mode), with its `dtype`."""
        info = self.call("GET", "/server_info", "the server-info request", timeout=30,
                         params={"config_format": "json"})
        where = self.where("/server_info", "the server-info request")
        hint = "; is it a vLLM server in development mode (VLLM_SERVER_DEV_MODE=1)?"
        mc = field(info, ("vllm_config", "model_config"), dict, where, hint)
        field(mc, ("dtype",), str, f"{where}, vllm_config.model_config", hint)
        return mc

    def dtype(self) -> str:
        d = self.model_config()["dtype"]
        if d not in SERVER_DTYPES:
            raise ParityError(f"vLLM server at {self.url} serves {d}; parity knows bf16, fp16 "
                              f"and fp32")
        return SERVER_DTYPES[d]

    def model(self) -> str:
        """The served model's name, asked once: every scoring request names it, and a server
        does not change what it serves under a running trainer."""
        if self._model is None:
            self._model = field(self.call("GET", "/v1/models", "the model list", timeout=30),
                                ("data", 0, "id"), str,
                                self.where("/v1/models", "the model list"))
        return self._model

    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[t] | ids[:t]) for t ≥ 1, as the server computes them at T = 1."""
        return self.score([ids], "the probe request")[0]

    def score(self, seqs: list[list[int]], what: str) -> list[torch.Tensor]:
        """`prompt_logprobs` of several sequences in one request (the server batches them);
        vLLM scores with the raw model, whatever the sampling's temperature and truncation."""
        out = self.call("POST", "/v1/completions", what, json={
            "model": self.model(), "prompt": seqs, "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0})
        where = self.where("/v1/completions", what)
        # vLLM's own field, not OpenAI's: a gateway in between that keeps only OpenAI's drops it.
        hint = ("; parity needs vLLM's `prompt_logprobs`: point it at the vLLM server itself, "
                "not a gateway that keeps only OpenAI's fields")
        by_index = {}
        for k in range(len(field(out, ("choices",), list, where))):
            i = field(out, ("choices", k, "index"), int, where)
            by_index[i] = field(out, ("choices", k, "prompt_logprobs"), list, where, hint)
        scores = []
        for i, ids in enumerate(seqs):
            at = f"{where}, choices[index={i}].prompt_logprobs"
            if i not in by_index or len(by_index[i]) != len(ids):
                raise ParityError(f"{at}: {len(by_index.get(i, []))} entries for a sequence of "
                                  f"{len(ids)} tokens{hint}")
            scores.append(torch.tensor(
                [field(row, (str(t), "logprob"), (int, float), f"{at}[{j + 1}]")
                 for j, (row, t) in enumerate(zip(by_index[i][1:], ids[1:]))],
                dtype=torch.float64))
        return scores


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int], dtype: str) -> torch.Tensor:
    """The same log-probs from the trainer-side copy in the server's dtype."""
    x = torch.tensor([ids])
    with torch.autocast("cpu", enabled=False), fp16_kernels(dtype, x.device, "emulate"):
        logits = model(input_ids=x).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]


def _changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Values that differ, compared as bit patterns (a float compare of bf16 is several times
    slower on CPU; -0.0 against 0.0 counts as a change, NaN against itself does not)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


# The largest mean |difference| per probe token accepted between the server and the reference:
# the kernel gap of two implementations of the same bf16 model is a few 1e-2 on SmolLM2-135M.
PROBE_TOLERANCE = 0.15


class DirectoryWeightTransfer:
    """TRL's `WeightTransferProtocol` through a directory both sides can reach (module
    docstring). `reference` (a copy of the policy in the server's dtype, plain attention) and
    `probe_ids` enable the check after each sync, to within `tolerance` (PROBE_TOLERANCE)."""

    def __init__(self, server_url: str, directory: str | os.PathLike, timeout: float = 600.0,
                 reference: torch.nn.Module | None = None, probe_ids: list[int] | None = None,
                 tolerance: float = PROBE_TOLERANCE):
        self.server = Server(server_url, timeout)
        self.directory = Path(directory).absolute()
        self.reference, self.probe_ids, self.tolerance = reference, probe_ids, tolerance
        self.dtype: str | None = None
        self.version = 0
        self.last: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach(self, reference: torch.nn.Module, probe_ids: list[int]) -> None:
        if len(probe_ids) < 2:
            raise ParityError("the weight-sync probe needs at least 2 tokens")
        self.reference, self.probe_ids = reference, list(probe_ids)

    # -- WeightTransferProtocol -------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        self.dtype = self.server.dtype()
        self.server.call("GET", "/is_paused", "the pause-state request", timeout=30)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ParityError(f"weight directory {self.directory}: {one_line(e)}") from None

    def pause(self) -> None:
        self.server.call("POST", "/pause", "the pause before a weight sync",
                         params={"mode": "keep"})

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.dtype is None:
            self.init_weight_transfer()
        t0 = time.perf_counter()
        tensors, changed, total = self._collect(iterator)
        n = self.version + 1
        path = self._write(tensors, n)
        t1 = time.perf_counter()
        self.server.call("POST", "/collective_rpc", f"the reload of {path}", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self.server.call("POST", "/update_weight_version", "the weight-version tag",
                         json={"new_version": f"parity-{n}"}, timeout=30)
        t2 = time.perf_counter()
        old = self.directory / f"v{self.version}"
        if self.version and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        self.version = n
        self.last = {mn.SYNC_WRITE_S: t1 - t0, mn.SYNC_RELOAD_S: t2 - t1,
                     mn.SYNC_BYTES: float(sum(t.numel() * t.element_size()
                                             for t in tensors.values()))}
        if total:
            self.last[mn.SYNC_CHANGED_FRAC] = changed / total

    def resume(self) -> None:
        self.server.call("POST", "/resume", "the resume after a weight sync")
        self.verify()
        self.history.append(dict(self.last))

    def destroy(self) -> None:
        if self.version:
            shutil.rmtree(self.directory / f"v{self.version}", ignore_errors=True)

    # -- the pieces -------------------------------------------------------------------------

    def _collect(self, iterator: Iterable[tuple[str, torch.Tensor]]
                 ) -> tuple[dict[str, torch.Tensor], int, int]:
        """The tensors in the server's dtype; copied into the reference as they pass, counting
        the values that changed (`sync/changed_frac`)."""
        ref = dict(self.reference.named_parameters()) if self.reference is not None else {}
        tensors, changed, total = {}, 0, 0
        for name, t in iterator:
            c = t.detach().to("cpu", TORCH[self.dtype]).contiguous()
            tensors[name] = c
            if name in ref and ref[name].dtype == c.dtype:
                p = ref[name]
                changed += _changed(p.data, c)
                total += p.numel()
                p.data.copy_(c)
        if self.reference is not None and not tensors.keys() & ref.keys():
            raise ParityError("the weights sent share no name with the reference model")
        return tensors, changed, total

    def _write(self, tensors: dict[str, torch.Tensor], n: int) -> Path:
        tmp, final = self.directory / f".v{n}.tmp", self.directory / f"v{n}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(tensors, str(tmp / "model.safetensors"))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)   # the server never sees a half-written file
        except (OSError, SafetensorError) as e:
            # safetensors reports the system's write errors (a full disk) as its own error
            shutil.rmtree(tmp, ignore_errors=True)
            needed = sum(t.numel() * t.element_size() for t in tensors.values())
            raise write_failure(e, self.directory, needed, f"the weights of sync {n} to",
                                after="; the partial write was removed") from None
        return final

    def verify(self) -> None:
        """The server serves the weights just sent, or ParityError (module docstring, 5)."""
        what = "the weight-version request"
        tag = field(self.server.call("GET", "/weight_info", what, timeout=30), ("weight_version",),
                    str, self.server.where("/weight_info", what))
        if tag != f"parity-{self.version}":
            raise ParityError(f"vLLM server at {self.server.url} reports weight version "
                              f"{tag!r} after sync parity-{self.version}")
        if self.reference is None or not self.probe_ids:
            return
        srv = self.server.prompt_logprobs(self.probe_ids)
        ref = reference_logprobs(self.reference, self.probe_ids, self.dtype)
        gap = float((srv - ref).abs().mean())
        self.last[mn.SYNC_PROBE_GAP_ABS_MEAN] = gap
        if gap > self.tolerance:
            raise ParityError(f"vLLM server at {self.server.url} does not serve the weights just "
                              f"sent: its log-probs of the probe differ by {gap:.3g} per token "
                              f"from a {self.dtype} forward of them (tolerance "
                              f"{self.tolerance:g})")
        if self._prev is not None:
            prev_srv, prev_ref = self._prev
            self.last[mn.SYNC_PROBE_MOVED_ABS_MEAN] = float((srv - prev_srv).abs().mean())
            if torch.equal(srv, prev_srv) and not torch.equal(ref, prev_ref):
                raise ParityError(f"vLLM server at {self.server.url} serves stale weights: its "
                                  f"log-probs of the probe did not change at sync "
                                  f"parity-{self.version}, though the weights they depend on did")
        self._prev = (srv, ref)


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter, as TRL's trainer streams them to the server."""
    for name, p in model.named_parameters():
        yield name, p.detach()


@contextlib.contextmanager
def dev_server(model_dir: str | os.PathLike, dtype: str, log: str | os.PathLike,
               port: int = 0, startup_s: float = 300.0, cpus: str | None = None,
               extra: Iterable[str] = ()) -> Iterator[str]:
    """A vLLM OpenAI server in development mode on 127.0.0.1, serving `model_dir` under its own
    path as AsyncGRPO asks for it; yields its URL and always stops it, with its engine
    processes (its own process group). The batch-token budget keeps prompts' prefill whole: on
    CPU, vLLM 0.32 dies on a seeded request whose prefill is split ("CPU Generator does not use
    offset"), and AsyncGRPO seeds every request. `cpus` ("1", "2-3"): the cores the server and
    its OpenMP threads keep to, so that a trainer on the other cores does not share them.
    `extra`: more server flags, after these (a later flag wins)."""
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    flag = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", flag, "--enforce-eager", "--max-num-batched-tokens", "16384",
           "--logprobs-mode", "processed_logprobs", *extra]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if proc.poll() is not None:
                raise ParityError(f"the vLLM server exited at start-up; see {log}")
            try:
                if request("GET", url + "/health", "vLLM", 2).status == 200:
                    break
            except ParityError:
                pass
            if time.time() > deadline:
                raise ParityError(f"the vLLM server was not up in {startup_s:.0f} s; see {log}")
            time.sleep(2)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
