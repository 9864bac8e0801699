"""Reward functions with TRL's signature, held to their contract: the built-in ones, and the
user's `module:function` loaded, called on copies, awaited when asynchronous, and checked.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from parity.errors import ParityError, one_line
from parity.files import read_python
from parity.tasks.data import arith_correct

RewardFn = Callable[..., list[float]]
# Rewards become float32 tensors, and their batch mean and std are float32 sums: a reward near
# float32's largest value (3.4e38) turns them into inf. 1e30 leaves room for sums over any batch.
REWARD_LIMIT = 1e30



@dataclass
class Reward:
    fn: RewardFn
    name: str           # the function's name, as TRL logs it: rewards/<name>/mean
    spec: str           # what the user wrote, for error messages
    weight: float = 1.0


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


def arith_reward(prompts: list[str], completions: list[str], answer: list[str],
                 **_: Any) -> list[float]:
    return [float(arith_correct(c, a)) for c, a in zip(completions, answer)]


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


