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

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import random
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from parity import arith, testbed, ui
from parity.errors import ParityError, one_line
from parity.files import (
    arrow_rows,
    ensure_writable,
    exists,
    json_lines,
    parse_json,
    quiet_libraries,
    read_json,
    read_parquet,
    read_python,
    read_text,
)

RewardFn = Callable[..., list[float]]
BUILTIN = ("neg-length", "neg-length-chat", "arith")

ARITH_CANDIDATES = 512
ARITH_SAMPLES = 40
ARITH_PROBE = 32  # problems sampled before a model that solves none of them is refused
ARITH_BAND = (0.2, 0.8)
# Rewards become float32 tensors, and their batch mean and std are float32 sums: a reward near
# float32's largest value (3.4e38) turns them into inf. 1e30 leaves room for sums over any batch.
REWARD_LIMIT = 1e30


@dataclass
class Reward:
    fn: RewardFn
    name: str           # the function's name, as TRL logs it: rewards/<name>/mean
    spec: str           # what the user wrote, for error messages
    weight: float = 1.0


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


def _call_reward(rw: Reward, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list], row_idx: list[int]) -> list[float]:
    n = len(completions)
    # Copies: a function may consume or change what it is given, as it may with TRL's lists,
    # and the count checked below, the next function, the trainer's token ids and the task's
    # rows must not see it.
    given = copy.deepcopy((prompts, completions, completion_ids, columns))
    try:
        out = rw.fn(given[0], given[1], completion_ids=given[2], **given[3])
        if inspect.isawaitable(out):   # an `async def` reward, which TRL awaits
            out = _await(out)
    except Exception as e:  # the user's code: report it, do not crash with its traceback
        raise ParityError(f"reward function {rw.spec} raised {one_line(e)}") from None
    except SystemExit as e:  # graders call sys.exit(); it must not end the run unexplained
        raise ParityError(f"reward function {rw.spec} called sys.exit({e.code!r}) while scoring "
                          f"prompt rows {_rows_text(row_idx)}; a reward function must return "
                          f"its values, not exit") from None
    try:
        items = list(out)
    except TypeError:
        raise ParityError(f"reward function {rw.spec} must return a list of numbers, got "
                          f"{type(out).__name__}") from None
    values = []
    for i, v in enumerate(items):
        try:
            values.append(float(v))
        except (TypeError, ValueError):
            raise ParityError(f"reward function {rw.spec} must return a list of numbers; value "
                              f"{i} (prompt row {row_idx[i] if i < len(row_idx) else '?'}) is "
                              f"{v!r:.60} ({type(v).__name__})") from None
    if len(values) != n:
        raise ParityError(f"reward function {rw.spec} returned {len(values)} values for "
                          f"{n} completions")
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ParityError(f"reward function {rw.spec} returned {v} for completion {i} "
                              f"(prompt row {row_idx[i]}); rewards must be finite")
        if abs(v) > REWARD_LIMIT:
            raise ParityError(f"reward function {rw.spec} returned {v:g} for completion {i} "
                              f"(prompt row {row_idx[i]}); rewards must lie within "
                              f"+-{REWARD_LIMIT:g}")
    return values


_REWARD_LOOP: asyncio.AbstractEventLoop | None = None


def _await(awaitable: Any) -> Any:
    """An async reward's result, awaited as TRL awaits one: on one event loop that runs in a
    daemon thread for the whole process, so that what the function keeps between calls (a
    client session) stays on the loop it was made on."""
    global _REWARD_LOOP
    if _REWARD_LOOP is None:
        _REWARD_LOOP = asyncio.new_event_loop()
        threading.Thread(target=_REWARD_LOOP.run_forever, daemon=True,
                         name="parity-rewards").start()

    async def outcome() -> tuple[bool, Any]:
        try:
            return False, await awaitable
        except (SystemExit, KeyboardInterrupt) as e:
            # Raised on the loop they would stop it before the wait below hears of them: they
            # are raised again in the caller's thread, where _call_reward reports sys.exit().
            return True, e
    stopped, value = asyncio.run_coroutine_threadsafe(outcome(), _REWARD_LOOP).result()
    if stopped:
        raise value
    return value


def _rows_text(rows: list[int]) -> str:
    shown = sorted(set(rows))
    return ", ".join(map(str, shown[:8])) + (f" ... ({len(shown)} in all)" if len(shown) > 8
                                             else "")


def load_rewards(specs: list[str], weights: list[float] | None = None) -> list[Reward]:
    """Each `module:function` spec imported; names made unique the way TRL's log needs them."""
    weights = weights or [1.0] * len(specs)
    out: list[Reward] = []
    for spec, w in zip(specs, weights):
        fn, _ = load_reward(spec)
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if any(r.name == name for r in out):
            name = f"{name}_{len(out)}"
        out.append(Reward(fn, name, spec, w))
    return out


def neg_length_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                      **_: Any) -> list[float]:
    return [-float(len(ids)) for ids in completion_ids]


# Questions with a short answer: with "Answer briefly." 8-42% of SmolLM2-135M-Instruct's first
# completions run past 64 tokens, against 50-88% on text fragments (docs/reproduce/smollm2-135m).
_QUESTIONS = ("What is {a} + {b}?", "What is {a} times {b}?", "Is {a} an even number?",
              "What is the capital of {country}?", "Name a {thing}.",
              "What color is {obj}?", "Give me a synonym for '{adj}'.",
              "Translate '{word}' into {lang}.", "How many legs does {animal} have?",
              "What is the opposite of '{adj}'?", "Spell the word '{word}' backwards.",
              "Which is larger, {a} or {b}?")
_FILL = {"country": ("France", "Japan", "Italy", "Spain", "Egypt", "Canada", "Brazil", "Kenya",
                     "Peru", "Norway"),
         "thing": ("color", "fruit", "planet", "musical instrument", "vegetable", "river"),
         "obj": ("the sky", "grass", "snow", "a banana", "a tomato", "coal"),
         "adj": ("happy", "fast", "cold", "big", "bright", "quiet"),
         "word": ("cat", "house", "water", "book", "tree", "bread"),
         "lang": ("French", "Spanish", "German", "Italian"),
         "animal": ("a dog", "a spider", "a bird", "an ant", "a horse", "a snake")}


def chat_questions(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """n one-message conversations asking a short question (`neg-length-chat`'s prompts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        fill = {k: rng.choice(v) for k, v in _FILL.items()}
        q = _QUESTIONS[i % len(_QUESTIONS)].format(a=rng.randint(2, 99), b=rng.randint(2, 99),
                                                  **fill)
        out.append([{"role": "user", "content": f"{q} Answer briefly."}])
    rng.shuffle(out)
    return out


def arith_reward(prompts: list[str], completions: list[str], answer: list[str],
                 **_: Any) -> list[float]:
    return [float(arith.correct(c, a)) for c, a in zip(completions, answer)]


def load_reward(spec: str) -> tuple[RewardFn, str]:
    """`module:function` (importable from the working directory) or `path/to/file.py:function`.
    Only this explicit flag ever imports user code."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ParityError(f"--reward {spec!r} must look like module:function or file.py:function")
    try:
        module = _reward_module(mod_name)
    except ParityError:
        raise
    except Exception as e:  # the user's module, run on import: any exception at all
        raise ParityError(f"cannot import reward module {mod_name!r}: {one_line(e)}") from None
    except SystemExit as e:
        raise ParityError(f"reward module {mod_name!r} called sys.exit({e.code!r}) on "
                          f"import") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ParityError(f"reward module {mod_name!r} has no function {fn_name!r}")
    return fn, spec


def _reward_module(mod_name: str) -> Any:
    """The module. Its source goes through `read_python` first: Python's own import would
    report a file that is not text as a SyntaxError without the byte's offset in the file."""
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if path.is_dir():
            raise ParityError(f"reward file {path} is a directory, not a Python file")
        if not path.is_file():
            raise ParityError(f"reward file {path} does not exist")
        read_python(path, "reward file")
        sp = importlib.util.spec_from_file_location(f"parity_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(sp)
        sp.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    found = importlib.util.find_spec(mod_name)
    if found is not None and found.origin and found.origin.endswith(".py"):
        read_python(found.origin, "reward module")
    return importlib.import_module(mod_name)


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
    import datasets
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
               chat_template: bool = False, cache: Path | None = None,
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
    path = (cache or testbed.cache_dir()) / "tasks" / f"arith-{key}.json"
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
        q, a = arith.problem(rng)
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
        rates = arith.solve_rates(model, problems, ARITH_SAMPLES, temperature, tok=tokenizer,
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
               chat_template: bool = False) -> Task:
    """`reward`: one `module:function` spec, a comma-separated string of them, or a list;
    it replaces a built-in task's own reward."""
    specs = ([x.strip() for x in reward.split(",")] if isinstance(reward, str)
             else list(reward or []))
    if name == "neg-length":
        rows = [{"prompt": p} for p in testbed.text_prompts(256, seed=seed)]
        task = Task(name, rows, [Reward(neg_length_reward, "neg_length", "neg-length")])
    elif name == "neg-length-chat":
        rows = [{"prompt": q} for q in chat_questions(256, seed=seed)]
        task = Task(name, rows, [Reward(neg_length_reward, "neg_length", "neg-length-chat")])
    elif name == "arith":
        rows, info = arith_rows(model_dir, model, tokenizer, seed, temperature, chat_template)
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
