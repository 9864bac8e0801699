"""A running OpenAI-compatible server (vLLM) over HTTP: its served models, and completions with
the sampled tokens' ids and log-probs, asked for as docs/serving.md says.

The standard library's urllib, one request per call, each bounded by a timeout: a server that
is down, that answers slower than the timeout, with an HTTP error or with something that is not
JSON is one ParityError line naming the address, never a hang or a traceback.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
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
                       s: Sampling, seed: int, stop_ids: list[int]) -> dict[str, Any]:
    """`/v1/completions` with the prompt as token ids: the server samples exactly the prompt
    the trainer scores, and returns each choice's token ids and sampled log-probs."""
    return {"model": model, "prompt": prompt_ids, **_common(n, max_tokens, s, seed, stop_ids),
            "max_tokens": max_tokens, "logprobs": 1}


def chat_request(model: str, messages: list[dict[str, str]], n: int, max_tokens: int,
                 s: Sampling, seed: int, stop_ids: list[int]) -> dict[str, Any]:
    """`/v1/chat/completions`: the server applies its own chat template; `return_token_ids`
    gives back the prompt it built and each choice's tokens."""
    return {"model": model, "messages": messages, **_common(n, max_tokens, s, seed, stop_ids),
            "max_completion_tokens": max_tokens, "logprobs": True, "top_logprobs": 0}


def _common(n: int, max_tokens: int, s: Sampling, seed: int, stop_ids: list[int]
            ) -> dict[str, Any]:
    # `seed`: vLLM seeds choice i of a request with seed + i, so a rerun samples the same tokens.
    return {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            **NEUTRAL, "seed": seed, "stop_token_ids": stop_ids, "return_token_ids": True,
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
