"""How parity calls a reward function (parity/tasks/rewards.py): each call gets its own copies of
the prompts, completions, token ids and columns, as a function may consume or change them, and an
`async def` reward is awaited, as TRL awaits one."""

from __future__ import annotations

import asyncio
import sys
import warnings

import pytest

from parity.errors import ParityError
from parity.tasks import Task
from parity.tasks.rewards import Reward

COMPLETIONS = ["ab", "c", "def", ""]
IDS = [[5, 6], [7], [8, 9, 10], [0]]


def lengths(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def consumes(prompts, completions, **_):
    out = []
    while completions:
        out.append(float(len(completions.pop())))
    return out[::-1]


def clears_then_scores(prompts, completions, **_):
    completions.clear()
    return [float(len(c)) for c in completions]


def changes_everything(prompts, completions, completion_ids, answer, **_):
    for ids in completion_ids:
        ids.clear()
    completion_ids.clear()
    prompts[0][0]["content"] = "changed"
    answer[0].append("changed")
    return [1.0] * len(completions)


def _task(*fns) -> Task:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": [str(i)]}
            for i in range(2)]
    return Task("t", rows, [Reward(f, f.__name__, f"rewards.py:{f.__name__}") for f in fns])


def test_a_reward_that_consumes_its_list_leaves_the_next_one_every_completion():
    total, parts = _task(consumes, lengths).reward_parts([0, 0, 1, 1], list(COMPLETIONS),
                                                         [list(x) for x in IDS])
    # conversations: each completion reaches the functions as one assistant message
    assert parts["consumes"] == [1.0] * 4
    assert parts["lengths"] == [1.0] * 4
    assert total == [2.0] * 4


def test_the_count_is_of_the_completions_given_not_of_what_is_left():
    with pytest.raises(ParityError, match=r"clears_then_scores returned 0 values for 4 "
                                          r"completions$"):
        _task(clears_then_scores).reward_parts([0, 0, 1, 1], list(COMPLETIONS),
                                               [list(x) for x in IDS])


def test_what_a_reward_changes_reaches_neither_the_caller_nor_the_task():
    task = _task(changes_everything, lengths)
    comps, ids = list(COMPLETIONS), [list(x) for x in IDS]
    total, _ = task.reward_parts([0, 0, 1, 1], comps, ids)
    assert total == [2.0] * 4
    assert comps == COMPLETIONS and ids == IDS
    assert task.rows[0] == {"prompt": [{"role": "user", "content": "q0"}], "answer": ["0"]}


async def async_lengths(prompts, completions, **_):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


LOOPS: list[int] = []


async def on_one_loop(prompts, completions, **_):
    LOOPS.append(id(asyncio.get_running_loop()))
    return [0.0] * len(completions)


async def async_raises(prompts, completions, **_):
    raise ValueError("judge unreachable")


async def async_exits(prompts, completions, **_):
    sys.exit("no judge")


def test_an_async_reward_is_awaited_on_one_loop_for_the_whole_run():
    task = Task("t", [{"prompt": "p"}], [Reward(f, f.__name__, f.__name__)
                                         for f in (async_lengths, on_one_loop)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "coroutine ... was never awaited" fails the test
        for _ in range(2):
            total, _ = task.reward_parts([0, 0], ["ab", "c"], [[1, 2], [3]])
            assert total == [2.0, 1.0]
    assert len(LOOPS) == 2 and LOOPS[0] == LOOPS[1]


@pytest.mark.parametrize("fn,words", [
    (async_raises, "async_raises raised ValueError: judge unreachable"),
    (async_exits, "async_exits called sys.exit('no judge') while scoring prompt rows 0"),
])
def test_an_async_reward_that_fails_is_one_line(fn, words):
    task = Task("t", [{"prompt": "p"}], [Reward(fn, fn.__name__, fn.__name__)])
    with pytest.raises(ParityError) as e:
        task.reward_parts([0, 0], ["ab", "c"], [[1, 2], [3]])
    assert words in str(e.value)
    # the loop survives: the next async reward is still awaited
    ok = Task("t", [{"prompt": "p"}], [Reward(async_lengths, "a", "a")])
    assert ok.reward_parts([0], ["abc"], [[1]])[0] == [3.0]
