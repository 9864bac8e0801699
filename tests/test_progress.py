"""Long work says what it is doing: a rollout slower than its grace period reports its progress
(in the bar on screen, or on stderr without one), a quick one stays silent."""

from __future__ import annotations

import time

from parity import ui


def test_a_quick_rollout_says_nothing(capsys):
    tick = ui.Ticker("rollout", 256, "positions", after_s=30.0)
    for t in range(256):
        tick(t)
    assert capsys.readouterr().err == ""


def test_a_slow_rollout_reports_on_stderr_without_a_bar(capsys):
    tick = ui.Ticker("rollout (vLLM)", 256, "decode steps", after_s=0.0)
    tick.last -= 11.0   # as if the last line were 11 s old
    tick(100)
    err = capsys.readouterr().err
    assert err.startswith("parity: rollout (vLLM): 100/256 decode steps, ")
    tick(101)   # within 10 s of the last line: nothing more
    assert capsys.readouterr().err == ""


def test_a_slow_rollout_reports_in_the_bar_on_screen(capsys):
    with ui.progress("train", 3, transient=True) as bar:
        tick = ui.Ticker("rollout", 256, "positions", after_s=0.0)
        time.sleep(1.01)   # the bar is refreshed at most once a second
        tick(64)
        task = bar.progress.tasks[0]
        assert task.description.startswith("rollout: 64/256 positions, ")
    assert "parity: rollout" not in capsys.readouterr().err
