"""parity's one HTTP client (parity/engines/server.py) against real HTTP servers on loopback that
answer as a misbehaving server or gateway does: a total deadline per answer, no redirect
followed to another address, and every field parity reads checked, each a one-line ParityError
naming the endpoint (docs/errors.md). No model is loaded: the fast tier."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from parity.cli import main
from parity.engines.server import Server, request
from parity.errors import ParityError
from parity.integrations.weight_sync import DirectoryWeightTransfer
from parity.integrations.weight_sync import Server as VLLMServer

MODELS = {"object": "list", "data": [{"id": "m", "root": "m", "max_model_len": 512}]}


@pytest.fixture
def serve():
    """serve(routes) -> URL: a real HTTP server on 127.0.0.1 in a thread. `routes` maps a path
    to (status, body, headers) or to a function writing the answer itself; `hits` counts the
    requests each server received."""
    started = []

    def start(routes):
        hits = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                hits.append(self.path)
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                route = routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"}, {}))
                if callable(route):
                    return route(self)
                status, body, headers = route
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # polled every 0.05 s: shutdown() waits for one poll (0.5 s at the default)
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", hits
    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _drip(headers_too: bool, every_s: float = 0.2):
    """An answer sent one byte every `every_s`: each socket read gets a byte well within the
    timeout, the whole answer takes seconds (~15 s at 0.2 s)."""
    def answer(h):
        data = json.dumps(MODELS).encode()
        head = (f"HTTP/1.0 200 OK\r\nContent-Length: {len(data)}\r\n"
                f"Content-Type: application/json\r\n\r\n").encode()
        try:
            if not headers_too:
                h.wfile.write(head)
                h.wfile.flush()
            for b in (head + data if headers_too else data):
                h.wfile.write(bytes([b]))
                h.wfile.flush()
                time.sleep(every_s)
        except OSError:   # the client gave up: what the test wants
            pass
    return answer


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_a_server_sending_a_byte_at_a_time_meets_the_deadline(serve, headers_too):
    url, _ = serve({"/v1/models": _drip(headers_too)})
    t0 = time.monotonic()
    with pytest.raises(ParityError) as e:
        Server(url, 0.5).models()
    took = time.monotonic() - t0
    assert f"server {url}/v1/models: no answer within 0.5 s (server_timeout_s" in str(e.value)
    assert took < 1.3, took   # the whole answer would take ~14 s


def test_a_slow_answer_within_the_deadline_is_read(serve):
    url, _ = serve({"/v1/models": _drip(True, every_s=0.005)})
    assert Server(url, 60).models() == MODELS["data"]


def test_a_redirect_to_another_address_is_not_followed(serve):
    elsewhere, elsewhere_hits = serve({"/v1/models": (200, MODELS, {})})
    target = f"{elsewhere}/v1/models"
    url, _ = serve({"/v1/models": (302, "", {"Location": target})})
    with pytest.raises(ParityError) as e:
        Server(url, 5).models()
    assert str(e.value).startswith(f"server {url}/v1/models: redirected (HTTP 302) to {target}, "
                                   f"another address")
    assert elsewhere_hits == []


def test_a_redirect_on_the_same_server_is_followed_and_a_posts_body_is_kept(serve):
    url, hits = serve({"/v1/models": (301, "", {"Location": "/v1/models/"}),
                       "/v1/models/": (200, MODELS, {}),
                       "/v1/completions": (302, "", {"Location": "/v2/completions"})})
    assert Server(url, 5).models() == MODELS["data"]
    assert hits == ["/v1/models", "/v1/models/"]
    with pytest.raises(ParityError, match=r"redirected \(HTTP 302\) to .*/v2/completions, which "
                                          r"drops the request's body"):
        Server(url, 5).post("/v1/completions", {"prompt": [1]})


def test_an_answer_cut_short_is_one_line(serve):
    def short(h):
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b'{"data": [')
    url, _ = serve({"/v1/models": short})
    with pytest.raises(ParityError, match=r"/v1/models: the connection closed 90 bytes before"):
        Server(url, 5).models()


def test_a_server_that_is_down_is_one_line_through_the_client():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ParityError, match=r"^here: cannot connect \(connection refused\)"):
        request("GET", f"http://127.0.0.1:{port}/v1/models", "here", 5)


# ---- the weight sync's calls (parity/integrations/weight_sync.py) ----------------------------

def test_server_info_without_vllm_config_is_one_line(serve):
    url, _ = serve({"/server_info": (200, {"version": "0.32.0"}, {})})
    with pytest.raises(ParityError) as e:
        VLLMServer(url).dtype()
    assert str(e.value).startswith(f"vLLM server at {url}/server_info (the server-info request): "
                                   f"no field 'vllm_config' in the answer")
    url, _ = serve({"/server_info": (200, {"vllm_config": {"model_config": {"dtype": 16}}}, {})})
    with pytest.raises(ParityError, match=r"vllm_config.model_config: field 'dtype' is an "
                                          r"integer '16' where text belongs"):
        VLLMServer(url).dtype()


def test_weight_info_as_an_html_page_is_one_line(serve, tmp_path):
    url, _ = serve({"/weight_info": (200, "<html><body>Gateway page</body></html>",
                                     {"Content-Type": "text/html"})})
    sync = DirectoryWeightTransfer(url, tmp_path)
    sync.version = 1
    with pytest.raises(ParityError) as e:
        sync.verify()
    assert str(e.value) == (f"vLLM server at {url}/weight_info (the weight-version request): the "
                            f"answer is not JSON: '<html><body>Gateway page</body></html>'")


def test_scoring_without_prompt_logprobs_is_one_line(serve):
    openai_only = {"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
    url, _ = serve({"/v1/models": (200, MODELS, {}),
                    "/v1/completions": (200, openai_only, {})})
    with pytest.raises(ParityError) as e:
        VLLMServer(url).prompt_logprobs([1, 2, 3])
    assert str(e.value).startswith(f"vLLM server at {url}/v1/completions (the probe request): no "
                                   f"field 'choices[0].prompt_logprobs' in the answer; parity "
                                   f"needs vLLM's `prompt_logprobs`")


def test_scores_are_read_from_prompt_logprobs(serve):
    # What vLLM answers: a null for the first token, then {token id: {logprob, ...}} per token.
    answer = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"2": {"logprob": -0.5, "rank": 1}}, {"3": {"logprob": -1.25, "rank": 4}}]}]}
    url, _ = serve({"/v1/models": (200, MODELS, {}), "/v1/completions": (200, answer, {})})
    assert VLLMServer(url).prompt_logprobs([1, 2, 3]).tolist() == [-0.5, -1.25]


# ---- `parity audit --server` ------------------------------------------------------------------

def test_shadow_kernels_scored_is_refused_with_a_server_as_with_rollouts(tmp_path, capsys):
    with socket.socket() as s:   # refused before any request: nothing needs to listen here
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    for source, flag in ((["--task", "neg-length", "--server", url], "--server"),
                         (["--rollouts", "r.jsonl"], "--rollouts")):
        out = tmp_path / "out"
        # a model that is not there: a refusal that came late would name it, not load one
        code = main(["audit", "--model", str(tmp_path / "none"), *source, "--shadow-kernels",
                     "scored", "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.strip() == (f"parity: error: shadow_kernels=scored needs the engine that "
                               f"sampled: audit a --task or --prompts with parity's engine, not "
                               f"{flag}"), err
        assert not out.exists()
