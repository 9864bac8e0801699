"""`parity audit --server URL`: sample the audit's prompts from a running OpenAI-compatible
server (vLLM), keep its answers as a rollouts file, and check what can be checked about it.

The answers are saved one request and response per line, the form `parity audit --rollouts`
reads (parity/audit/responses.py); the audit then reads that file as it reads any other, so a
live audit and the audit of its saved file are the same computation (docs/serving.md).

What is checked about the server, and how:
- the model: `/v1/models` names what it serves (vLLM: `id`, `root`, `max_model_len`); the entry
  is compared with the trainer's model directory and name, and a prompt that cannot fit the
  server's context is refused before any request;
- the log-probs: with temperature != 1, top-k or top-p, vLLM returns the raw model's log-probs
  unless started with `--logprobs-mode processed_logprobs`. The first completions' ℓ_μ are
  compared with the trainer's log-probs of the same tokens under the sampled (processed) and
  the unmodified (raw) distribution: the nearer one, by a factor of 2 at least, is what the
  server returns. Raw log-probs would be counted as β; the audit refuses them;
- with the chat endpoint, whether the server's chat template gave the trainer's prompt tokens.
"""

from __future__ import annotations

import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parity import ui
from parity.audit.inputs import to_rollout
from parity.audit.responses import server_rows
from parity.config import AuditSettings
from parity.engines import stop_token_ids
from parity.engines.server import Server, chat_request, completion_request
from parity.errors import ParityError
from parity.logprobs import Sampling
from parity.models.forward import score
from parity.models.precision import autocast
from parity.objectives import grpo_advantages
from parity.tasks import PromptSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from parity.tasks import Task

CHECK_ROWS = 16     # completions whose ℓ_μ are compared with the trainer's processed and raw
CLEAR = 2.0         # how much nearer one of the two must be for a finding


def served_model(server: Server, a: AuditSettings, model_dir: Path) -> dict[str, Any]:
    """The served model the audit samples from, and how it compares with the trainer's."""
    models = server.models()
    ids = [m["id"] for m in models]
    if a.server_model is not None:
        entry = next((m for m in models if m["id"] == a.server_model), None)
        if entry is None:
            raise ParityError(f"server {server.url} does not serve {a.server_model!r}; it "
                              f"serves {', '.join(map(repr, ids))}")
    elif len(models) == 1:
        entry = models[0]
    else:
        raise ParityError(f"server {server.url} serves {len(ids)} models "
                          f"({', '.join(map(repr, ids))}); name one with --server-model")
    root = entry.get("root") if isinstance(entry.get("root"), str) else entry["id"]
    if Path(root).is_dir() and Path(root).resolve() == model_dir.resolve():
        match = "same directory"
    elif {Path(root).name, Path(entry["id"]).name} & {model_dir.name, Path(a.model).name}:
        match = "same name"
    else:
        match = "different"
        print(f"parity: warning: server {server.url} serves {entry['id']!r} (root {root}), "
              f"not the trainer's model {a.model} ({model_dir}) by name or path; beta is then "
              f"the gap between two models if they differ", file=sys.stderr)
    return {"url": server.url, "model": entry["id"], "root": root,
            "max_model_len": entry.get("max_model_len"), "trainer_model_match": match}


def endpoint(a: AuditSettings, prompts: list[Any]) -> str:
    if a.server_endpoint != "auto":
        return a.server_endpoint
    return "chat" if a.chat_template or isinstance(prompts[0], list) else "completions"


def sample(server: Server, a: AuditSettings, info: dict[str, Any], model: torch.nn.Module,
           tok: PreTrainedTokenizerBase, task: Task | None, prompts: list[Any],
           prompt_ids: list[list[int]], s: Sampling) -> list[dict[str, Any]]:
    """One saved line per request ({request, response[, reward, advantage]}): `group` choices
    of each prompt, drawn in the order `audit._sample` draws them."""
    limit = info.get("max_model_len")
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    if isinstance(limit, int) and len(prompt_ids[longest]) + a.max_new_tokens > limit:
        raise ParityError(f"server {server.url} serves {info['model']!r} with a context of "
                          f"{limit} tokens; prompt {longest} is {len(prompt_ids[longest])} "
                          f"tokens and max_new_tokens={a.max_new_tokens}")
    chat = endpoint(a, prompts) == "chat"
    info["endpoint"] = "/v1/chat/completions" if chat else "/v1/completions"
    stops = stop_token_ids(model, tok)
    order = PromptSampler(len(prompt_ids), a.seed)
    per_round = max(1, a.batch_size // a.group)
    lines: list[dict[str, Any]] = []
    same_prompt = 0
    with ui.progress("server", a.samples, a.progress, transient=True) as bar, \
            ThreadPoolExecutor(per_round) as pool:
        while len(lines) * a.group < a.samples:
            n = min(per_round, -(-(a.samples - len(lines) * a.group) // a.group))
            rows = order.next(n)
            bodies = []
            for i in rows:
                if chat:
                    p = prompts[i] if isinstance(prompts[i], list) else [
                        {"role": "user", "content": prompts[i]}]
                    bodies.append(chat_request(info["model"], p, a.group, a.max_new_tokens, s,
                                               stops))
                else:
                    bodies.append(completion_request(info["model"], prompt_ids[i], a.group,
                                                     a.max_new_tokens, s, stops))
            path = info["endpoint"]
            answers = pool.map(functools.partial(server.post, path), bodies)
            for i, body, ans in zip(rows, bodies, answers):
                line = {"request": body, "response": ans}
                got = server_rows(line, f"server {server.url}{path}, prompt {i}", tok)
                if len(got) != a.group:
                    # A group of another size would be audited as --group: fewer samples than
                    # asked, and a group of one has no group-relative advantage (its std is NaN).
                    raise ParityError(f"server {server.url}{path}, prompt {i}: "
                                      f"{len(got)} choice{'s' * (len(got) != 1)} where the "
                                      f"request asked for n={a.group}; the "
                                      f"server ignores `n`: audit a server that honours it "
                                      f"(vLLM does)")
                same_prompt += all(c["prompt_token_ids"] == prompt_ids[i] for c in got)
                if task is not None:
                    comp = [c["completion_token_ids"] for c in got]
                    texts = tok.batch_decode(comp, skip_special_tokens=True)
                    rewards = task.rewards([i] * len(got), texts, comp)
                    line["reward"] = rewards
                    line["advantage"] = grpo_advantages(
                        torch.tensor(rewards, device="cpu"), len(got)).tolist()
                lines.append(line)
            bar.completed(min(len(lines) * a.group, a.samples))
    info["prompts_as_trainer_tokenizes"] = f"{same_prompt} of {len(lines)}"
    return lines


@torch.no_grad()
def logprobs_kind(model: torch.nn.Module, tok: PreTrainedTokenizerBase,
                  rows: list[dict[str, Any]], a: AuditSettings, s: Sampling) -> dict[str, Any]:
    """Whether the server's ℓ_μ are of the sampled distribution (processed) or of the raw
    model, from the first completions scored by the trainer both ways."""
    if s.temperature == 1.0 and not s.truncates:
        return {"logprobs": "not checked: at temperature 1 without top-k/top-p, processed and "
                            "raw log-probs are the same"}
    device = next(model.parameters()).device
    chunk = rows[:CHECK_ROWS]
    r = to_rollout(chunk, tok.pad_token_id, tok.eos_token_id).to(device)
    with autocast(a.trainer_dtype, device, a.cpu_fp16):
        processed, raw = (score(model, r, how, chunk=a.logprob_chunk) for how in (s, Sampling()))
    m = r.completion_mask > 0
    mu, processed, raw = r.engine_logprobs[m], processed[m], raw[m]
    d_proc = (mu - processed).abs().mean().item()
    d_raw = (mu - raw).abs().mean().item()
    found = {"tokens": int(m.sum()), "mean_abs_diff_to_processed": d_proc,
             "mean_abs_diff_to_raw": d_raw,
             "processed_vs_raw_mean_abs_diff": (processed - raw).abs().mean().item()}
    if d_raw * CLEAR <= d_proc:
        raise ParityError(f"the server returns the raw model's log-probs, not those of the "
                          f"distribution it samples (temperature {s.temperature:g}, top-p "
                          f"{s.top_p:g}, top-k {s.top_k}): over {found['tokens']} tokens they "
                          f"are {d_raw:.3g} from the trainer's raw log-probs and {d_proc:.3g} "
                          f"from its processed ones; start vLLM with --logprobs-mode "
                          f"processed_logprobs, or audit at temperature 1 without top-k/top-p")
    if d_proc * CLEAR <= d_raw:
        return {"logprobs": "processed", **found}
    print(f"parity: warning: cannot tell whether the server's log-probs are processed or raw: "
          f"{d_proc:.3g} from the trainer's processed log-probs, {d_raw:.3g} from its raw ones",
          file=sys.stderr)
    return {"logprobs": "undetermined", **found}
