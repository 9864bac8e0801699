"""Tasks: prompts plus a reward function with TRL's signature

    reward(prompts: list[str], completions: list[str], **columns) -> list[float]

where `columns` holds every dataset column for each completion's row, plus `completion_ids`
(token ids, EOS included when sampled), as TRL passes them. Built in:

- `neg-length`: reward = −(completion tokens); the best policy emits EOS at once.
- `neg-length-chat`: the same reward on short questions asked as a chat (one user message,
  rendered with the model's chat template), for instruct models: their answers to a text
  fragment run past any token budget, so most completions would be truncated, every truncated
  one has the same reward, and the group advantage carries no signal.
- `arith`: exact-match arithmetic on problems the model solves 20–80% of the time over 40
  samples, measured by really sampling from the model before training (cached).
- a dataset file (JSONL, parquet, or a `datasets` directory) with a `prompt` column, rewarded by
  the user's `--reward module:function[,module:function...]`, summed with `--reward-weights`.

A prompt is a string, or a conversation (a list of {role, content} messages, TRL's
"conversational" format) rendered with the tokenizer's chat template; completions of a
conversation reach the reward function as [{"role": "assistant", "content": text}], as in TRL.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from parity import ui
from parity.errors import ParityError, one_line
from parity.files import (
    arrow_rows,
    cache_dir,
    ensure_writable,
    exists,
    json_lines,
    parse_json,
    quiet_libraries,
    read_json,
    read_parquet,
    read_text,
)
from parity.tasks.data import arith_problem, chat_questions, text_prompts
from parity.tasks.rewards import (
    REWARD_LIMIT,
    Reward,
    _call_reward,
    arith_reward,
    load_rewards,
    neg_length_reward,
)

# What the arith filter asks of a sampler: each problem's solve rate, sampled from the model
# (the run's layer passes the testbed's `solve_rates`, so that no task data needs an engine).
SolveRates = Callable[..., list[float]]

BUILTIN = ("neg-length", "neg-length-chat", "arith")

ARITH_CANDIDATES = 512
ARITH_SAMPLES = 40
ARITH_PROBE = 32  # problems sampled before a model that solves none of them is refused
ARITH_BAND = (0.2, 0.8)


@dataclass
class Task:
    name: str
    rows: list[dict[str, Any]]                  # each has "prompt" and any other columns
    reward_fns: list[Reward]
    prompt_ids: list[list[int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def rewards(self, row_idx: list[int], completions: list[str],
                completion_ids: list[list[int]]) -> list[float]:
        """The weighted sum of the reward functions, each held to its contract."""
        total, _ = self.reward_parts(row_idx, completions, completion_ids)
        return total

    def reward_parts(self, row_idx: list[int], completions: list[str],
                     completion_ids: list[list[int]]
                     ) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted sum, each function's own values by name); any breach is a ParityError."""
        rows = [self.rows[i] for i in row_idx]
        prompts = [r["prompt"] for r in rows]
        columns = {k: [r.get(k) for r in rows] for k in self.rows[0] if k != "prompt"}
        shown: list[Any] = list(completions)
        if prompts and isinstance(prompts[0], list):  # a conversation: answer as TRL does
            shown = [[{"role": "assistant", "content": c}] for c in completions]
        total = [0.0] * len(completions)
        parts: dict[str, list[float]] = {}
        for rw in self.reward_fns:
            values = _call_reward(rw, prompts, shown, completion_ids, columns, row_idx)
            parts[rw.name] = values
            total = [t + rw.weight * v for t, v in zip(total, values)]
        for i, t in enumerate(total):
            if not abs(t) <= REWARD_LIMIT:  # NaN too: weights times values can overflow
                raise ParityError(f"the weighted sum of the rewards is {t:g} for completion {i} "
                                  f"(prompt row {row_idx[i]}); with reward_weights "
                                  f"{[rw.weight for rw in self.reward_fns]} it must lie within "
                                  f"+-{REWARD_LIMIT:g}")
        return total, parts


def load_rows(path: str) -> list[dict[str, Any]]:
    """A dataset's rows: JSON Lines or one JSON array (.jsonl/.json), parquet, or a `datasets`
    save_to_disk directory; every row must hold a prompt."""
    p = Path(path)
    if not exists(p, "dataset"):
        raise ParityError(f"task {path!r} is neither a built-in task ({', '.join(BUILTIN)}) "
                          f"nor an existing dataset file")
    if p.is_dir():
        rows, where = _saved_rows(p), None
    elif p.suffix in (".jsonl", ".json"):
        rows, where = _json_rows(p)
    elif p.suffix == ".parquet":
        rows, where = arrow_rows(read_parquet(p, "dataset"), f"dataset {p}"), None
    else:
        raise ParityError(f"dataset {p} must be .jsonl, .json, .parquet or a dataset "
                          f"directory")
    if not rows:
        raise ParityError(f"dataset {p} is empty: it has no rows")
    names = list(dict.fromkeys(k for r in rows for k in r))
    if "prompt" not in names:
        raise ParityError(f"dataset {p} has no 'prompt' column (columns: "
                          f"{', '.join(map(str, names))})")
    # Every row gets every column, None where a row lacks it, as `datasets` loads a file.
    rows = [{k: r.get(k) for k in names} for r in rows]
    for i, row in enumerate(rows):
        check_prompt(row["prompt"], where[i] if where else f"dataset {p} row {i}")
    return rows


def _json_rows(p: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of a JSON Lines file, or of a .json file holding one array; with where each is."""
    text = read_text(p, "dataset")
    if p.suffix == ".json" and text.lstrip().startswith("["):
        data = parse_json(text, f"dataset {p}")
        if not all(isinstance(r, dict) for r in data):
            raise ParityError(f"dataset {p}: a JSON array of rows must hold only objects")
        return data, [f"dataset {p} row {i}" for i in range(len(data))]
    rows, where = [], []
    for n, row in json_lines(p, "dataset", text):
        if not isinstance(row, dict):
            raise ParityError(f"dataset {p} line {n}: a row must be a JSON object, got "
                              f"{type(row).__name__}")
        where.append(f"dataset {p} row {len(rows)} (line {n})")
        rows.append(row)
    return rows, where


def _saved_rows(p: Path) -> list[dict[str, Any]]:
    """Rows of a `datasets` save_to_disk directory (a DatasetDict's train split, else its
    first)."""
    import datasets  # start-up: about a second, for a saved `datasets` directory only
    for f in sorted(p.glob("*.json")) + sorted(p.glob("*/*.json")):  # datasets' own metadata:
        read_json(f, "dataset file")  # named here with its offset, not by a bare decode error
    try:
        with quiet_libraries():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            table = ds.with_format("arrow")[:]
    except Exception as e:  # `datasets` raises whatever its readers raise
        raise ParityError(f"cannot read dataset {p}: {one_line(e)}") from None
    return arrow_rows(table, f"dataset {p}")


def check_prompt(prompt: Any, where: str) -> None:
    """A non-empty string, or a non-empty list of {role, content} messages."""
    if isinstance(prompt, str):
        if not prompt:
            raise ParityError(f"{where}: field 'prompt' is empty")
        return
    if isinstance(prompt, list) and prompt:
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ParityError(f"{where}: prompt message {j} must be a mapping with string "
                                  f"'role' and 'content'")
        return
    raise ParityError(f"{where}: field 'prompt' must be a non-empty string or a list of "
                      f"{{role, content}} messages, got {type(prompt).__name__}")


def prompt_token_ids(tok: Any, prompt: str | list[dict], chat_template: bool,
                     where: str = "prompt") -> list[int]:
    """Token ids of a prompt: a conversation (or, with `chat_template`, a plain prompt as one
    user message) goes through the tokenizer's chat template with the assistant turn opened.
    `where` names the prompt (a dataset row) when the template refuses it."""
    if not isinstance(prompt, list) and not chat_template:
        return list(tok(prompt)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise ParityError("the prompt is a conversation (or --chat-template is on) but the "
                          "model's tokenizer has no chat template (tokenizer_config.json "
                          "'chat_template' or chat_template.jinja)")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        out = _apply_template(tok, messages)
    except Exception as e:  # the template is the model's code (jinja); it may raise anything
        j = _refused_message(tok, messages)
        which = (f"message {j} (role {messages[j]['role']!r})" if j is not None else
                 f"the conversation (roles {', '.join(m['role'] for m in messages)})")
        raise ParityError(f"{where}: the model's chat template refuses {which}: "
                          f"{one_line(e)}") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _apply_template(tok: Any, messages: list[dict]) -> Any:
    with quiet_libraries():
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def _refused_message(tok: Any, messages: list[dict]) -> int | None:
    """The first message whose addition makes the template raise (a role it rejects, a turn
    out of order); None when every prefix renders."""
    for j in range(len(messages)):
        try:
            _apply_template(tok, messages[:j + 1])
        except Exception:
            return j
    return None


def arith_rows(model_dir: Path, model: Any, tokenizer: Any, seed: int, temperature: float,
               solve_rates: SolveRates, chat_template: bool = False, cache: Path | None = None,
               progress: bool = True) -> tuple[list[dict], dict]:
    """The filtered arith problem set for this model: every candidate really sampled
    ARITH_SAMPLES times at the run's temperature, from the prompt the run will feed it (chat
    template included); cached beside the testbed models."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    stamp = [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights]
    # The sampler's name: a filter drawn by another sampler is another sample of solve rates.
    key_parts = [str(model_dir.resolve()), stamp, seed, temperature, ARITH_CANDIDATES,
                 ARITH_SAMPLES, "engine-cdf"] + (["chat-template"] if chat_template else [])
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:16]
    path = (cache or cache_dir()) / "tasks" / f"arith-{key}.json"
    if path.is_file():
        try:
            data = read_json(path, "arith cache")
            return data["rows"], data["info"]
        except (ParityError, TypeError, KeyError):
            pass  # a damaged cache entry is measured again and replaced
    ensure_writable(path.parent, "testbed cache")
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    while len(seen) < ARITH_CANDIDATES:  # distinct problems only
        q, a = arith_problem(rng)
        seen.setdefault(q, a)
    problems = list(seen.items())
    ids = [prompt_token_ids(tokenizer, q, chat_template, "arith") for q, _ in problems]
    with ui.progress("arith: solve rates", len(problems) * ARITH_SAMPLES, progress,
                     eta=True) as bar:
        def seen_enough(done: int, total: int, solved: int) -> None:
            bar.completed(done)
            # Bounded cost for a model that cannot do the task at all (a chat model answers
            # in words, not `95<eos>`): stop at the first batch of at least ARITH_PROBE
            # problems rather than sample all of them.
            if solved == 0 and done >= ARITH_PROBE * ARITH_SAMPLES:
                raise ParityError(
                    f"arith: {model_dir} solved none of the first {done // ARITH_SAMPLES} "
                    f"problems in {ARITH_SAMPLES} samples each (the task wants the sum alone, "
                    f"then end of sequence, within 8 tokens); arith cannot train this model: "
                    f"use neg-length, or a dataset with your own --reward")
        rates = solve_rates(model, problems, ARITH_SAMPLES, temperature, tok=tokenizer,
                                  seed=seed, prompt_ids=ids, on_batch=seen_enough)
    lo, hi = ARITH_BAND
    rows = [{"prompt": q, "answer": a, "solve_rate": r}
            for (q, a), r in zip(problems, rates) if lo <= r <= hi]
    info = {"candidates": len(problems), "kept": len(rows), "samples": ARITH_SAMPLES,
            "band": list(ARITH_BAND), "candidate_solve_rate": sum(rates) / len(rates),
            "kept_solve_rate": sum(r["solve_rate"] for r in rows) / max(len(rows), 1)}
    if not rows:
        raise ParityError(f"arith: none of {len(problems)} problems is solved 20-80% of the time "
                          f"by {model_dir}; the model is too weak or too strong for this task")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": rows, "info": info}))
    tmp.replace(path)
    return rows, info


def build_task(name: str, reward: str | list[str] | None, model_dir: Path, model: Any,
               tokenizer: Any, max_new_tokens: int, max_positions: int | None, seed: int,
               temperature: float, reward_weights: list[float] | None = None,
               chat_template: bool = False, solve_rates: SolveRates | None = None) -> Task:
    """`reward`: one `module:function` spec, a comma-separated string of them, or a list;
    it replaces a built-in task's own reward."""
    specs = ([x.strip() for x in reward.split(",")] if isinstance(reward, str)
             else list(reward or []))
    if name == "neg-length":
        rows = [{"prompt": p} for p in text_prompts(256, seed=seed)]
        task = Task(name, rows, [Reward(neg_length_reward, "neg_length", "neg-length")])
    elif name == "neg-length-chat":
        rows = [{"prompt": q} for q in chat_questions(256, seed=seed)]
        task = Task(name, rows, [Reward(neg_length_reward, "neg_length", "neg-length-chat")])
    elif name == "arith":
        if solve_rates is None:
            raise ValueError("the arith task is built with a sampler for its solve rates")
        rows, info = arith_rows(model_dir, model, tokenizer, seed, temperature, solve_rates,
                                chat_template)
        task = Task(name, rows, [Reward(arith_reward, "arith", "arith")], info=info)
    else:
        if not specs:
            raise ParityError(f"task {name!r} is a dataset: give its reward function with "
                              f"--reward module:function")
        rows = load_rows(name)
        task = Task(Path(name).name, rows, [])
    if specs:
        task.reward_fns = load_rewards(specs, reward_weights)
    task.prompt_ids = [prompt_token_ids(tokenizer, r["prompt"], chat_template,
                                        f"task {name}: row {i}")
                       for i, r in enumerate(task.rows)]
    for i, ids in enumerate(task.prompt_ids):
        if not ids:
            raise ParityError(f"task {name}: row {i}: prompt tokenizes to nothing")
        check_fits(f"task {name}: row {i}", len(ids), "max_new_tokens", max_new_tokens,
                   max_positions)
    return task


def check_fits(where: str, prompt_tokens: int, budget: str, new_tokens: int,
               positions: int | None) -> None:
    """A prompt and the longest completion it may get within the model's positions, or one
    line naming the prompt: past them a model with learned positions fails mid-run (an
    IndexError) and one with rotary positions goes on at positions it never learned.
    `budget` names the setting that allows `new_tokens`."""
    if positions is not None and prompt_tokens + new_tokens > positions:
        raise ParityError(f"{where}: prompt is {prompt_tokens} tokens; with {budget}="
                          f"{new_tokens} it exceeds the model's context of {positions} "
                          f"positions")


class PromptSampler:
    """Deterministic data order: shuffled epochs over the rows, drawn `n` at a time."""

    def __init__(self, n_rows: int, seed: int):
        self.n_rows, self.seed, self.epoch, self.pos = n_rows, seed, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(self.n_rows))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.pos == self.n_rows:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            take = min(n - len(out), self.n_rows - self.pos)
            out += self._order[self.pos:self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = s["epoch"], s["pos"]
        self._order = self._shuffle()
