"""Audit input from a serving engine: what an OpenAI-compatible server (vLLM, SGLang) or
SGLang's native `/generate` answered, saved as JSON lines, turned into the audit's rows
(`prompt_token_ids`, `completion_token_ids`, `engine_logprobs`; docs/design.md).

A line is either the server's response as it came (`choices`, or SGLang's `meta_info`), or
`{"request": <the request body>, "response": <the response>}` where the prompt's token ids are
in the request only; `advantage` or `reward` beside them (a number, or one per choice) is kept.
Each choice is one completion. Request options that make a server return what this needs, and
why: docs/serving.md.

Token ids are taken as the server gave them, in this order: a choice's `token_ids` (vLLM's
`return_token_ids`), the log-prob entries' tokens spelled `token_id:N` (vLLM's
`return_tokens_as_token_ids`), SGLang's `[logprob, token_id, text]` triples. Where only token
text is there, the text is tokenized again and must give back the server's tokens one for one;
a prompt given only as text (or chat messages, through the model's chat template) must give as
many tokens as the server counted (`usage.prompt_tokens`). Anything else is refused, naming the
line, the choice and the field.
"""

from __future__ import annotations

import json
from typing import Any

from parity.errors import ParityError

TOKEN_ID_PREFIX = "token_id:"
_KIND = {str: "text", dict: "a JSON object", list: "a list", int: "an integer"}


def _typed(v: Any, kind: type, at: str, field: str, required: bool = False) -> Any:
    """`v` when it is of `kind`; None when absent or null (proxies and gateways write an absent
    field as null) and not `required`; else one line naming the line and the field."""
    if isinstance(v, kind) and not (kind is int and isinstance(v, bool)):
        return v
    if v is None and not required:
        return None
    got = "null" if v is None else f"{type(v).__name__} {json_text(v)}"
    raise ParityError(f"{at}, field {field!r}: {got} where {_KIND[kind]} belongs")


def _ints(v: Any, at: str, field: str) -> list[int] | None:
    """A list of integer token ids, or None when absent or null."""
    if _typed(v, list, at, field) is None:
        return None
    for j, x in enumerate(v):
        _typed(x, int, at, f"{field}[{j}]", required=True)
    return v


def _numbers(v: list, at: str, field: str) -> list[float]:
    for j, x in enumerate(v):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            got = "null" if x is None else f"{type(x).__name__} {json_text(x)}"
            raise ParityError(f"{at}, field {field!r}: {got} at token {j} where a log-prob (a "
                              f"number) belongs")
    return v


def json_text(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def is_server_line(row: dict[str, Any]) -> bool:
    return "choices" in row or "meta_info" in row or "response" in row


def server_rows(row: dict[str, Any], at: str, tok: Any) -> list[dict[str, Any]]:
    """The audit rows (one per choice) of one saved server line."""
    request = _typed(row.get("request"), dict, at, "request") or {}
    response = row.get("response", row)
    if not isinstance(response, dict):
        raise ParityError(f"{at}: `request` and `response` must be JSON objects")
    if "meta_info" in response:
        choices = [_sglang_native(response, request, at, tok)]
    elif isinstance(response.get("choices"), list) and response["choices"]:
        kind = _typed(response.get("object"), str, at, "object") or ""
        chat = kind.startswith("chat") or any(
            isinstance(c, dict) and "message" in c for c in response["choices"])
        choices = [_openai_choice(c, k, response, request, chat, f"{at}, choice {k}", tok)
                   for k, c in enumerate(response["choices"])]
    else:
        raise ParityError(f"{at}: no `choices` (an OpenAI-compatible response) and no "
                          f"`meta_info` (SGLang's /generate): not a server response")
    for name in ("advantage", "reward"):
        v = row.get(name)
        if isinstance(v, list):
            if len(v) != len(choices):
                raise ParityError(f"{at}, field {name!r}: {len(v)} values for {len(choices)} "
                                  f"choices")
            for c, x in zip(choices, v):
                c[name] = x
        elif v is not None:
            for c in choices:
                c[name] = v
    return choices


# ---- OpenAI-compatible: /v1/completions and /v1/chat/completions ----------------------------

def _openai_choice(c: Any, k: int, response: dict, request: dict, chat: bool, at: str,
                   tok: Any) -> dict[str, Any]:
    if not isinstance(c, dict):
        raise ParityError(f"{at}: a choice must be a JSON object")
    lp = c.get("logprobs")
    if not isinstance(lp, dict):
        ask = '"logprobs": true' if chat else '"logprobs": 1'
        raise ParityError(f"{at}, field 'logprobs': missing; the request must ask for the "
                          f"sampled tokens' log-probs ({ask})")
    if chat:
        entries = lp.get("content")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ParityError(f"{at}, field 'logprobs.content': must be a list of "
                              f"{{token, logprob}} objects")
        tokens = [e.get("token") for e in entries]
        logprobs = _numbers([e.get("logprob") for e in entries], at, "logprobs.content.logprob")
        field = "logprobs.content"
    else:
        tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
        for name, v in (("tokens", tokens), ("token_logprobs", logprobs)):
            if not isinstance(v, list):
                raise ParityError(f"{at}, field 'logprobs.{name}': must be a list")
        _numbers(logprobs, at, "logprobs.token_logprobs")
        field = "logprobs.tokens"
    ids = _completion_ids(_ints(c.get("token_ids"), at, "token_ids"), tokens, at, field, tok)
    prompt = (_ints(c.get("prompt_token_ids"), at, "prompt_token_ids")
              or _ints(response.get("prompt_token_ids"), at, "prompt_token_ids")
              or _prompt_from_request(request, response, chat, at, tok))
    return {"prompt_token_ids": prompt, "completion_token_ids": ids, "engine_logprobs": logprobs}


def _completion_ids(given: Any, tokens: list, at: str, field: str, tok: Any) -> list[int]:
    if given is not None:
        if not isinstance(given, list) or len(given) != len(tokens):
            raise ParityError(f"{at}, field 'token_ids': {_count(given)} for {len(tokens)} "
                              f"log-prob entries (one per completion token)")
        return given
    if tokens and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        try:
            return [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
        except ValueError:
            raise ParityError(f"{at}, field {field!r}: a `token_id:N` entry is not a "
                              f"number") from None
    if not all(isinstance(t, str) for t in tokens):
        raise ParityError(f"{at}, field {field!r}: tokens must be text or `token_id:N`")
    return _retokenized(tokens, at, field, tok)


def _retokenized(tokens: list[str], at: str, field: str, tok: Any) -> list[int]:
    """The ids of the server's token texts, from tokenizing their concatenation again: only
    when that gives back exactly the same tokens (a token split differently, or text that
    decodes lossily, would score other tokens than those sampled)."""
    ids = tok.encode("".join(tokens), add_special_tokens=False)
    back = [tok.decode([i]) for i in ids]
    if back != tokens:
        first = next((j for j, (a, b) in enumerate(zip(back, tokens)) if a != b),
                     min(len(back), len(tokens)))
        raise ParityError(f"{at}, field {field!r}: tokenizing the completion's text again gives "
                          f"{len(ids)} tokens where the server returned {len(tokens)}, first "
                          f"different at token {first}; ask the server for token ids "
                          f"(vLLM: \"return_tokens_as_token_ids\": true), docs/serving.md")
    return ids


def _prompt_from_request(request: dict, response: dict, chat: bool, at: str,
                         tok: Any) -> list[int]:
    """The prompt's token ids from the request: as given when the prompt is token ids; else
    the prompt text (completions) or the messages through the chat template (chat), tokenized
    as the server does and checked against the server's own count."""
    if not request:
        raise ParityError(f"{at}: the response has no prompt_token_ids and the line no "
                          f"`request`; save {{\"request\": ..., \"response\": ...}} or ask for "
                          f"token ids (vLLM: \"return_token_ids\": true), docs/serving.md")
    prompt = request.get("messages") if chat else request.get("prompt")
    field = "request.messages" if chat else "request.prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if chat and isinstance(prompt, list) and prompt:
        ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
    elif not chat and isinstance(prompt, str) and prompt:
        ids = tok.encode(prompt)  # with the tokenizer's special tokens, as servers add them
    else:
        raise ParityError(f"{at}, field {field!r}: missing, or neither text nor token ids")
    usage = _typed(response.get("usage"), dict, at, "usage") or {}
    counted = _typed(usage.get("prompt_tokens"), int, at, "usage.prompt_tokens")
    if counted is None:
        raise ParityError(f"{at}, field 'usage.prompt_tokens': missing, so the prompt "
                          f"tokenized here cannot be checked against the server's; ask for "
                          f"token ids (vLLM: \"return_token_ids\": true)")
    if counted != len(ids):
        raise ParityError(f"{at}, field {field!r}: tokenized here it is {len(ids)} tokens, the "
                          f"server counted {counted}: another tokenizer or chat template; ask "
                          f"for token ids (vLLM: \"return_token_ids\": true)")
    return ids


# ---- SGLang's native /generate ---------------------------------------------------------------

def _sglang_native(response: dict, request: dict, at: str, tok: Any) -> dict[str, Any]:
    meta = response["meta_info"]
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(triples, list) or not all(
            isinstance(t, (list, tuple)) and len(t) >= 2 for t in triples):
        raise ParityError(f"{at}, field 'meta_info.output_token_logprobs': missing or not "
                          f"[logprob, token_id, ...] entries; the request must set "
                          f"\"return_logprob\": true")
    _numbers([t[0] for t in triples], at, "meta_info.output_token_logprobs")
    for j, t in enumerate(triples):
        _typed(t[1], int, at, f"meta_info.output_token_logprobs[{j}][1]", required=True)
    prompt = _ints(request.get("input_ids"), at, "request.input_ids")
    if not prompt:
        text = request.get("text")
        if not isinstance(text, str) or not text:
            raise ParityError(f"{at}: the prompt's token ids are not in the line: save the "
                              f"request with `input_ids` (or `text`) beside the response")
        prompt = tok.encode(text)
        counted = _typed(meta.get("prompt_tokens"), int, at, "meta_info.prompt_tokens")
        if counted != len(prompt):
            raise ParityError(f"{at}, field 'request.text': tokenized here it is "
                              f"{len(prompt)} tokens, the server counted "
                              f"{meta.get('prompt_tokens')}; send `input_ids` instead")
    return {"prompt_token_ids": prompt, "completion_token_ids": [t[1] for t in triples],
            "engine_logprobs": [t[0] for t in triples]}


def _count(v: Any) -> str:
    return f"{len(v)} ids" if isinstance(v, list) else "not a list"
