"""`parity audit --server URL` against real vLLM OpenAI servers that this module starts on
loopback (one returning processed log-probs, one raw), and its one-line refusals for a server
that is down, slow, or answers errors or non-JSON (a real HTTP server on loopback standing for a
misbehaving gateway).

The vLLM tests skip only where vLLM is not installed; with PARITY_REQUIRE_VLLM=1 (CI) they fail
instead."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from parity.cli import main
from parity.engines.server import LocalVLLM

pytestmark = pytest.mark.e2e

HAS_VLLM = importlib.util.find_spec("vllm") is not None
CONTEXT = 128   # the servers' --max-model-len, below text-xs's 256 positions
SAMPLING = ["--temperature", "0.8", "--top-k", "20"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(chat_model, tmp_path_factory):
    """{"processed": URL, "raw": URL}: vLLM serving text-xs (with a chat template) in bf16,
    started together and always stopped."""
    if not HAS_VLLM:
        if os.environ.get("PARITY_REQUIRE_VLLM") == "1":
            pytest.fail("PARITY_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed (set PARITY_REQUIRE_VLLM=1 to make this a failure)")
    logs = tmp_path_factory.mktemp("vllm-logs")
    started = {}
    try:
        for kind in ("processed", "raw"):  # both start at once, then both are waited for
            started[kind] = LocalVLLM(chat_model, "bfloat16", logs / f"{kind}.log",
                                      f"{kind}_logprobs", max_model_len=CONTEXT,
                                      kv_cache_bytes=256 << 20)
        yield {kind: server.wait() for kind, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def _audit(args: list[str], out: Path, capsys) -> tuple[int, str]:
    code = main(["audit", *args, "--out", str(out), "--no-progress", "--batch-size", "16"])
    return code, capsys.readouterr().err


def _error(code: int, err: str) -> str:
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("parity: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_live_audit_is_the_audit_of_the_answers_it_keeps(servers, chat_model, tmp_path,
                                                          capsys):
    live = tmp_path / "live"
    code, err = _audit(["--server", servers["processed"], "--model", str(chat_model),
                        "--samples", "32", "--group", "4", "--max-new-tokens", "24", *SAMPLING],
                       live, capsys)
    assert code == 0, err
    res = json.loads((live / "audit.json").read_text())
    v = res["server"]
    assert v["model"] == str(chat_model) and v["trainer_model_match"] == "same directory"
    assert v["max_model_len"] == CONTEXT and v["endpoint"] == "/v1/completions"
    assert v["prompts_as_trainer_tokenizes"] == "8 of 8"
    # processed ℓ_μ sit at the trainer's processed log-probs (bf16 against fp32), far from raw
    assert v["logprobs"] == "processed", v
    assert v["mean_abs_diff_to_processed"] < 0.05 < 0.2 < v["mean_abs_diff_to_raw"]
    m = res["metrics"]
    assert res["completions"] == 32 and 0 < m["mismatch/beta_abs_mean"] < 0.05
    # the server's whole gap to the trainer, against the per-token columns it was computed from
    t = pq.read_table(live / "tokens.parquet").to_pandas()
    gap = (t["trainer_logprob"] - t["engine_logprob"]).abs()
    assert len(t) == res["tokens"] and 0 < gap.mean() < 0.05
    assert m["mismatch/log_ratio_abs_mean"] == pytest.approx(gap.mean(), rel=1e-4)
    assert m["mismatch/log_ratio_abs_max"] == pytest.approx(gap.max(), rel=1e-4)
    lines = [json.loads(x) for x in (live / "rollouts.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for line in lines:  # the request options docs/serving.md lists, and the task's advantages
        q = line["request"]
        assert q["logprobs"] == 1 and q["return_token_ids"] and q["n"] == 4
        assert q["temperature"] == 0.8 and q["top_k"] == 20 and q["repetition_penalty"] == 1.0
        assert all(isinstance(t, int) for t in q["prompt"])
        assert len(line["response"]["choices"]) == len(line["advantage"]) == 4
    replay = tmp_path / "replay"
    code, err = _audit(["--rollouts", str(live / "rollouts.jsonl"), "--model", str(chat_model),
                        *SAMPLING], replay, capsys)
    assert code == 0, err
    again = json.loads((replay / "audit.json").read_text())
    assert again["metrics"] == res["metrics"]
    assert again["phantom_vs_eps"] == res["phantom_vs_eps"]


def test_the_chat_endpoint_uses_the_servers_chat_template(servers, chat_model, tmp_path,
                                                          capsys):
    out = tmp_path / "chat"
    code, err = _audit(["--server", servers["processed"], "--model", str(chat_model), "--task",
                        "neg-length-chat", "--samples", "8", "--group", "4",
                        "--max-new-tokens", "16"], out, capsys)
    assert code == 0, err
    res = json.loads((out / "audit.json").read_text())
    v = res["server"]
    assert v["endpoint"] == "/v1/chat/completions"
    assert v["prompts_as_trainer_tokenizes"] == "2 of 2"  # the same template on both sides
    assert v["logprobs"].startswith("not checked")         # T = 1, no truncation
    line = json.loads((out / "rollouts.jsonl").read_text().splitlines()[0])
    assert line["request"]["messages"][0]["role"] == "user" and line["request"]["logprobs"]
    assert 0 < res["metrics"]["mismatch/beta_abs_mean"] < 0.05


def test_raw_log_probs_are_refused_where_they_differ(servers, chat_model, tmp_path, capsys):
    out = tmp_path / "raw"
    args = ["--server", servers["raw"], "--model", str(chat_model), "--samples", "8",
            "--group", "4", "--max-new-tokens", "16"]
    line = _error(*_audit(args + SAMPLING, out, capsys))
    assert "raw model's log-probs" in line and "--logprobs-mode processed_logprobs" in line
    assert not out.exists()
    # at temperature 1 without truncation raw and processed are the same: audited
    code, err = _audit(args, out, capsys)
    assert code == 0, err


def test_what_the_server_serves_is_checked(servers, chat_model, text_model, tmp_path, capsys):
    url = servers["processed"]
    line = _error(*_audit(["--server", url, "--model", str(chat_model), "--server-model",
                           "other"], tmp_path / "a", capsys))
    assert "does not serve 'other'" in line and str(chat_model) in line
    line = _error(*_audit(["--server", url, "--model", str(chat_model), "--max-new-tokens",
                           "120"], tmp_path / "b", capsys))
    assert f"context of {CONTEXT} tokens" in line and "max_new_tokens=120" in line
    # the same weights under another name and path: audited, with a warning that says so
    code, err = _audit(["--server", url, "--model", str(text_model), "--samples", "4",
                        "--group", "4", "--max-new-tokens", "8"], tmp_path / "c", capsys)
    assert code == 0, err
    assert "parity: warning: server" in err and "not the trainer's model" in err
    v = json.loads((tmp_path / "c" / "audit.json").read_text())["server"]
    assert v["trainer_model_match"] == "different"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- a server that is down, slow, or answers what no OpenAI server does ----------------------

MODELS = {"object": "list", "data": [{"id": "m", "root": "m", "max_model_len": 512}]}
GATEWAYS = {  # name: (answer to /v1/models, to /v1/completions), each (status, body, delay)
    "completion-error": ((200, MODELS, 0), (500, {"error": {"message": "upstream boom"}}, 0)),
    "html-models": ((200, "<html>Bad Gateway</html>", 0), None),
    "slow-models": ((200, MODELS, 3), None),
    "slow-completion": ((200, MODELS, 0), (200, {}, 3)),
    "no-models": ((200, {"object": "list", "data": []}, 0), None),
    "not-a-model-list": ((200, {"models": ["m"]}, 0), None),
    "completion-without-logprobs": ((200, MODELS, 0), (200, {"object": "text_completion",
                                                             "choices": [{"text": "x"}]}, 0)),
    "two-models": ((200, {"data": [{"id": "a"}, {"id": "b"}]}, 0), None),
    "ignores-n": ((200, MODELS, 0), (200, {"object": "text_completion", "choices": [
        {"index": 0, "text": "x", "token_ids": [5],
         "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}]}, 0)),
}
WORDS = {
    "completion-error": ["/v1/completions", "HTTP 500", "upstream boom"],
    "html-models": ["/v1/models", "not JSON", "Bad Gateway"],
    "slow-models": ["/v1/models", "no answer within 0.5 s", "server_timeout_s"],
    "slow-completion": ["/v1/completions", "no answer within 0.5 s"],
    "no-models": ["serves no model"],
    "not-a-model-list": ["not an OpenAI model list"],
    "completion-without-logprobs": ["/v1/completions, prompt", "choice 0", "'logprobs'"],
    "two-models": ["serves 2 models", "--server-model"],
    "ignores-n": ["/v1/completions, prompt", "1 choice where the request asked for n=4",
                  "ignores `n`"],
}


@pytest.fixture
def gateway():
    """A real HTTP server on loopback answering as the named misbehaving gateway does."""
    started = []

    def serve(name: str) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, which: int) -> None:
                status, body, delay = GATEWAYS[name][which] or (404, {"detail": "Not Found"}, 0)
                time.sleep(delay)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up waiting
                    pass

            def do_GET(self):
                self._answer(0)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(1)
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # polled every 0.05 s: shutdown() waits for one poll (0.5 s at the default)
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"
    yield serve
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("name", list(GATEWAYS))
def test_a_misbehaving_server_is_one_line(name, gateway, text_model, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _audit(["--server", gateway(name), "--model", str(text_model),
                        "--server-timeout-s", "0.5", "--samples", "4", "--group", "4"], out, capsys)
    line = _error(code, err)
    assert "Warning" not in err, err   # a group of one once gave torch's std() warning first
    for w in WORDS[name]:
        assert w in line, line
    assert not out.exists()


def test_a_server_that_is_down_is_one_line(text_model, tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there once the probe closed
    line = _error(*_audit(["--server", url, "--model", str(text_model)], tmp_path / "o", capsys))
    assert url in line and "cannot connect (connection refused)" in line
    line = _error(*_audit(["--server", "127.0.0.1:8000", "--model", str(text_model)],
                          tmp_path / "o", capsys))
    assert "must be an http:// or https:// address" in line
    line = _error(*_audit(["--server", url, "--model", str(text_model), "--rollouts", "x.jsonl"],
                          tmp_path / "o", capsys))
    assert "--server samples the prompts" in line
    line = _error(*_audit(["--model", str(text_model), "--server-model", "m"], tmp_path / "o",
                          capsys))
    assert "--server-model and --server-endpoint apply with --server" in line
    assert not (tmp_path / "o").exists()
