"""`parity audit --rollouts` on what a serving engine answered: parity's own engine output written
as vLLM's and SGLang's responses (each way a server can give token ids, and text that must be
tokenized again) is audited to the numbers of the same completions in the native format."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli_helpers import assert_user_error
from parity.audit.command import audit
from parity.cli import main
from parity.config import AuditSettings
from parity.models.loading import load_policy

pytestmark = pytest.mark.e2e

KEYS = ("mismatch/beta_mean", "mismatch/beta_abs_mean", "mismatch/kl_k1", "mismatch/kl_k3",
        "clip/frac", "clip/phantom_frac", "mismatch/beta_adv_corr")


@pytest.fixture(scope="module")
def sampled(chat_model, tmp_path_factory):
    """Completions and ℓ_μ of parity's bf16 engine, one native row per completion, grouped by
    prompt as a server answers n choices per request."""
    out = tmp_path_factory.mktemp("sampled") / "a"
    audit(AuditSettings(model=str(chat_model), task="neg-length", samples=32, group=4,
                        max_new_tokens=12, progress=False), out)
    t = pq.read_table(out / "tokens.parquet").to_pandas()
    from parity.tasks import build_task
    model, tok = load_policy(chat_model)
    task = build_task("neg-length", None, chat_model, model, tok, 12, None, 0, 1.0)
    rows = []
    for _, g in t.groupby("sample_id", sort=True):
        g = g.sort_values("position")
        rows.append({"prompt_token_ids": task.prompt_ids[int(g["prompt_id"].iloc[0])],
                     "completion_token_ids": [int(x) for x in g["token_id"]],
                     "engine_logprobs": [float(x) for x in g["engine_logprob"]],
                     "advantage": float(g["advantage"].iloc[0])})
    return rows, tok


def _groups(rows):
    out = []
    for r in rows:
        if out and out[-1][0]["prompt_token_ids"] == r["prompt_token_ids"]:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _audited(model: Path, lines: list[dict], path: Path) -> dict:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = path.with_suffix("")
    assert main(["audit", "--rollouts", str(path), "--model", str(model), "--batch-size", "8",
                 "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / "audit.json").read_text())


def _completions(group, tok, ids_as):
    """A /v1/completions response with one choice per completion of a prompt."""
    choices = []
    for k, r in enumerate(group):
        ids = r["completion_token_ids"]
        tokens = ([f"token_id:{i}" for i in ids] if ids_as != "text" else
                  [tok.decode([i]) for i in ids])
        c = {"index": k, "text": tok.decode(ids), "finish_reason": "length",
             "logprobs": {"tokens": tokens, "token_logprobs": r["engine_logprobs"],
                          "top_logprobs": None, "text_offset": []}}
        if ids_as == "token_ids":
            c.update(prompt_token_ids=r["prompt_token_ids"], token_ids=ids)
        choices.append(c)
    return {"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": len(group[0]["prompt_token_ids"])}}


def _chat(group, tok, ids_as):
    choices = []
    for k, r in enumerate(group):
        ids = r["completion_token_ids"]
        content = [{"token": f"token_id:{i}" if ids_as != "text" else tok.decode([i]),
                    "logprob": lp, "top_logprobs": []}
                   for i, lp in zip(ids, r["engine_logprobs"])]
        c = {"index": k, "message": {"role": "assistant", "content": tok.decode(ids)},
             "logprobs": {"content": content}, "finish_reason": "length"}
        if ids_as == "token_ids":
            c["token_ids"] = ids
        choices.append(c)
    resp = {"id": "chatcmpl-0", "object": "chat.completion", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": len(group[0]["prompt_token_ids"])}}
    if ids_as == "token_ids":
        resp["prompt_token_ids"] = group[0]["prompt_token_ids"]
    return resp


def _advantages(group):
    return [r["advantage"] for r in group]


def test_vllm_and_sglang_responses_audit_to_the_native_numbers(sampled, chat_model, tmp_path):
    rows, tok = sampled
    native = _audited(chat_model, rows, tmp_path / "native.jsonl")
    groups = _groups(rows)
    formats = {
        # vLLM, "return_token_ids": true: the ids of prompt and completion in every choice
        "completions-token-ids": [{**_completions(g, tok, "token_ids"),
                                   "advantage": _advantages(g)} for g in groups],
        # vLLM, "return_tokens_as_token_ids": true, the prompt sent as token ids
        "completions-token-id-strings": [
            {"request": {"prompt": g[0]["prompt_token_ids"], "logprobs": 1},
             "response": _completions(g, tok, "token_id:N"), "advantage": _advantages(g)}
            for g in groups],
        "chat-token-ids": [{**_chat(g, tok, "token_ids"), "advantage": _advantages(g)}
                           for g in groups],
        # SGLang's /generate with "return_logprob": true, the prompt sent as input_ids
        "sglang-generate": [
            {"request": {"input_ids": r["prompt_token_ids"], "return_logprob": True},
             "response": {"text": tok.decode(r["completion_token_ids"]), "meta_info": {
                 "output_token_logprobs": [[lp, i, None] for lp, i in
                                           zip(r["engine_logprobs"], r["completion_token_ids"])],
                 "finish_reason": {"type": "length"},
                 "prompt_tokens": len(r["prompt_token_ids"])}},
             "advantage": r["advantage"]} for r in rows],
    }
    for name, lines in formats.items():
        got = _audited(chat_model, lines, tmp_path / f"{name}.jsonl")
        assert got["completions"] == native["completions"], name
        for k in KEYS:
            assert got["metrics"][k] == native["metrics"][k], (name, k)


def _round_trips(r, tok) -> bool:
    ids = r["completion_token_ids"]
    return tok.encode("".join(tok.decode([i]) for i in ids), add_special_tokens=False) == ids


def test_responses_given_as_text_are_tokenized_again_and_checked(sampled, chat_model, tmp_path):
    """A server that returns token text (no ids): the completion is tokenized again, and the
    prompt from the request's text or chat messages; the numbers are those of the native
    rows. Completions whose text does not tokenize back to the sampled tokens are refused."""
    rows, tok = sampled
    chat_prompt = [{"role": "user", "content": "hello"}]
    prompt_ids = tok.apply_chat_template(chat_prompt, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    keep = [dict(r, prompt_token_ids=list(prompt_ids)) for r in rows if _round_trips(r, tok)]
    assert len(keep) >= 8, "too few completions whose text tokenizes back to them"
    native = _audited(chat_model, keep, tmp_path / "native.jsonl")
    lines = [{"request": {"messages": chat_prompt, "logprobs": True},
              "response": _chat([r], tok, "text"), "advantage": r["advantage"]} for r in keep]
    got = _audited(chat_model, lines, tmp_path / "chat-text.jsonl")
    for k in KEYS:
        assert got["metrics"][k] == native["metrics"][k], k
    # A completion that its text does not give back: two tokens that read as one.
    pieces = [tok.decode([i]) for i in tok.encode("hello world", add_special_tokens=False)]
    j = next(j for j, p in enumerate(pieces) if len(p) >= 2)
    split = pieces[:j] + [pieces[j][:1], pieces[j][1:]] + pieces[j + 1:]
    bad = {"request": {"messages": chat_prompt},
           "response": {"object": "chat.completion", "usage": {"prompt_tokens": len(prompt_ids)},
                        "choices": [{"message": {"content": "".join(split)}, "logprobs": {
                            "content": [{"token": p, "logprob": -1.0} for p in split]}}]}}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "parity", "audit", "--rollouts", str(path),
                        "--model", str(chat_model), "--out", str(tmp_path / "bad"),
                        "--no-progress"], capture_output=True, text=True)
    assert_user_error(p, "line 1, choice 0", "logprobs.content", "tokenizing the completion's "
                      "text again", "return_tokens_as_token_ids")


BAD_LINES = [
    ({"choices": [{"text": "a", "finish_reason": "stop"}]}, ["line 1, choice 0",
                                                             "'logprobs': missing"]),
    ({"choices": [{"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]},
     ["line 1, choice 0", "no prompt_token_ids", "request"]),
    ({"request": {"prompt": "hi"}, "response": {"choices": [{"logprobs": {
        "tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]}},
     ["line 1, choice 0", "'usage.prompt_tokens': missing"]),
    ({"request": {"prompt": "hi"}, "response": {"usage": {"prompt_tokens": 99}, "choices": [
        {"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]}},
     ["line 1, choice 0", "'request.prompt'", "server counted 99"]),
    ({"choices": [{"prompt_token_ids": [5], "token_ids": [5, 6],
                   "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]},
     ["line 1, choice 0", "'token_ids'", "2 ids for 1"]),
    ({"choices": [{"prompt_token_ids": [5], "logprobs": {"tokens": ["token_id:x"],
                                                         "token_logprobs": [-1.0]}}]},
     ["line 1, choice 0", "token_id:N", "not a number"]),
    ({"choices": [{"prompt_token_ids": [5], "logprobs": {"tokens": ["token_id:5"],
                                                         "token_logprobs": [0.5]}}]},
     ["line 1, choice 0", "engine_logprobs", "positive"]),
    ({"response": {"meta_info": {"prompt_tokens": 1}}, "request": {"input_ids": [5]}},
     ["line 1", "meta_info.output_token_logprobs", "return_logprob"]),
    ({"response": {"id": "x"}}, ["line 1", "not a server response"]),
    ({"choices": [{"prompt_token_ids": [5], "logprobs": {"tokens": ["token_id:5"],
                                                         "token_logprobs": [-1.0]}}],
      "advantage": [1.0, 2.0]}, ["line 1", "'advantage'", "2 values for 1 choices"]),
    # Nulls and wrong types where a proxy or gateway rewrote a field: named by line and field
    # (an optional field given as null counts as absent: `object` here).
    ({"object": None, "choices": [{"prompt_token_ids": [5], "logprobs": {
        "tokens": ["token_id:5"], "token_logprobs": [None]}}]},
     ["line 1, choice 0", "'logprobs.token_logprobs': null at token 0", "number"]),
    ({"request": {"prompt": "hi"}, "response": {"usage": "2 tokens", "choices": [
        {"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]}},
     ["line 1, choice 0", "'usage': str \"2 tokens\" where a JSON object belongs"]),
    ({"request": {"prompt": "hi"}, "response": {"usage": {"prompt_tokens": "2"}, "choices": [
        {"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]}},
     ["line 1, choice 0", "'usage.prompt_tokens': str", "an integer"]),
    ({"choices": [{"prompt_token_ids": "5 6", "logprobs": {"tokens": ["token_id:5"],
                                                           "token_logprobs": [-1.0]}}]},
     ["line 1, choice 0", "'prompt_token_ids': str", "a list"]),
    ({"choices": [{"prompt_token_ids": [5, None], "logprobs": {
        "tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]},
     ["line 1, choice 0", "'prompt_token_ids[1]': null where an integer belongs"]),
    ({"object": "chat.completion", "choices": [{"prompt_token_ids": [5], "logprobs": {
        "content": [{"token": "token_id:5", "logprob": "-1.0"}]}}]},
     ["line 1, choice 0", "'logprobs.content.logprob': str", "at token 0"]),
    ({"request": "hi", "response": {"choices": []}}, ["line 1", "'request': str"]),
    ({"response": {"meta_info": {"output_token_logprobs": [[-1.0, None, "a"]]}},
      "request": {"input_ids": [5]}},
     ["line 1", "'meta_info.output_token_logprobs[0][1]': null"]),
]


@pytest.mark.parametrize("line,words", BAD_LINES)
def test_a_malformed_server_line_is_one_line_naming_it(line, words, text_model, tmp_path,
                                                       capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(line) + "\n")
    code = main(["audit", "--rollouts", str(path), "--model", str(text_model), "--out",
                 str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    msg = [x for x in err.splitlines() if x.startswith("parity: error:")]
    assert len(msg) == 1, err
    for w in words:
        assert w in msg[0], msg[0]
    assert not (tmp_path / "out").exists()
