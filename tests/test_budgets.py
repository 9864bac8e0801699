"""`pytest --budget` fails a test over twice its budget times the host's scale and lists one
over its scaled budget, and only there: the
scale is how much slower than the budgets' machine this host runs the reference workload
(tests/budgets.py), or what PARITY_BUDGET_SCALE pins it to."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import budgets

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
# pythonpath: the inner conftest imports tests/budgets.py, in xdist's workers too
INI = ("[pytest]\nmarkers =\n    e2e: end to end\n    slow: long\n    budget(seconds): budget\n"
       f"pythonpath = {Path(__file__).parent}\n")


def test_the_scale_is_how_much_slower_the_host_is_and_never_below_one():
    assert budgets.scale_of(0.3, reference_s=0.1) == pytest.approx(3.0)
    assert budgets.scale_of(0.125, reference_s=0.1) == pytest.approx(1.25)
    assert budgets.scale_of(0.1, reference_s=0.1) == 1.0
    assert budgets.scale_of(0.02, reference_s=0.1) == 1.0   # a faster host keeps the budgets
    assert budgets.scale_of(2 * budgets.REFERENCE_S) == pytest.approx(2.0)


def test_a_pinned_scale_is_used_as_given_and_a_bad_one_refused():
    assert budgets.pinned_scale({}) is None
    assert budgets.pinned_scale({"PARITY_BUDGET_SCALE": ""}) is None
    assert budgets.pinned_scale({"PARITY_BUDGET_SCALE": "2.5"}) == 2.5
    assert budgets.pinned_scale({"PARITY_BUDGET_SCALE": "0.5"}) == 0.5
    for bad in ("0", "-1", "fast", "nan", "inf"):
        with pytest.raises(ValueError, match="PARITY_BUDGET_SCALE must be a positive number"):
            budgets.pinned_scale({"PARITY_BUDGET_SCALE": bad})


def test_the_reference_time_is_the_best_repeat_after_an_untimed_warm_up():
    calls = []

    def run(sleeps):
        calls.append(1)
        time.sleep(sleeps[len(calls) - 1])

    best = budgets.best_time(lambda: run([0.2, 0.06, 0.02, 0.04]), 3, at_least=1, max_s=10)
    assert len(calls) == 4 and 0.02 <= best < 0.04, best
    calls.clear()   # past max_s it stops repeating, but not before at_least repeats
    sleeps = [0.0, 0.03, 0.03, 0.01, 0.0, 0.0]
    best = budgets.best_time(lambda: run(sleeps), 5, at_least=3, max_s=0.02)
    assert len(calls) == 4 and 0.01 <= best < 0.03, best


def _inner(pytester, monkeypatch, default_budget_s=None):
    # no third-party plugins in the inner runs: hypothesis' alone costs seconds each time
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    conftest = CONFTEST
    if default_budget_s is not None:
        conftest = conftest.replace("DEFAULT_BUDGET_S = 30.0",
                                    f"DEFAULT_BUDGET_S = {default_budget_s}")
    pytester.makeconftest(conftest)
    pytester.makeini(INI)


def test_a_test_fails_past_twice_its_scaled_budget_and_only_under_budget(pytester, monkeypatch):
    _inner(pytester, monkeypatch, default_budget_s=0.02)
    pytester.makepyfile(test_times="""
        import time
        import pytest

        @pytest.fixture
        def slow_setup():
            time.sleep(0.25)   # set-up is not the test's own call

        def test_over():
            time.sleep(0.25)   # over twice the scaled budget of 0.1 s

        def test_listed():
            time.sleep(0.14)   # over the scaled budget, within twice it

        def test_within_the_scaled_budget(slow_setup):
            time.sleep(0.05)   # 2.5 times the budget, within 5 times it

        @pytest.mark.budget(5)
        def test_raised():
            time.sleep(0.25)

        @pytest.mark.slow
        def test_slow_ones_are_not_budgeted():
            time.sleep(0.25)
        """)
    monkeypatch.setenv("PARITY_BUDGET_SCALE", "5")
    for workers in ([], ["-p", "xdist", "-n", "2"]):   # CI's two workers report back the same
        r = pytester.runpytest("--budget", "--runslow", "-q", *workers)
        r.assert_outcomes(passed=4, failed=1)
        out = r.stdout.str()
        assert re.search(r"test_over took 0\.\d s, over 2 times its budget of 0\.02 s × scale "
                         r"5\.00 \(pinned by PARITY_BUDGET_SCALE\) = 0\.1 s", out), out
        assert "budgets: scale 5.00 (pinned by PARITY_BUDGET_SCALE)" in out, out
        listed = re.findall(r"over budget, within 2 times it: (\S+) 0\.\d+ s against 0\.1 s", out)
        assert listed == ["test_times.py::test_listed"], out

    monkeypatch.setenv("PARITY_BUDGET_SCALE", "1")   # the scale is what let it pass
    r = pytester.runpytest("--budget", "-q", "-k", "within")
    r.assert_outcomes(failed=1)
    assert "over 2 times its budget of 0.02 s × scale 1.00" in r.stdout.str()

    r = pytester.runpytest("-q", "-k", "over")
    r.assert_outcomes(passed=1)
    assert "budgets:" not in r.stdout.str()


def test_the_scale_is_timed_at_the_start_and_printed_with_the_figure(pytester, monkeypatch):
    _inner(pytester, monkeypatch, default_budget_s=0.1)
    monkeypatch.delenv("PARITY_BUDGET_SCALE", raising=False)
    timed = []
    # a host that runs the workload 3 times slower than the budgets' machine (the inner
    # session's conftest takes time_reference from the module when it is imported)
    monkeypatch.setattr(budgets, "time_reference",
                        lambda: timed.append(1) or 3 * budgets.REFERENCE_S)
    pytester.makepyfile(test_quick="""
        import time

        def test_within_three_times_its_budget():
            time.sleep(0.15)
        """)
    r = pytester.runpytest("--budget", "-q")
    r.assert_outcomes(passed=1)
    assert timed == [1]
    assert (f"budgets: scale 3.00 (reference workload {3 * budgets.REFERENCE_S:.3f} s here, "
            f"{budgets.REFERENCE_S:g} s where the budgets were set)") in r.stdout.str()

    timed.clear()
    pytester.runpytest("-q").assert_outcomes(passed=1)
    assert timed == []   # without --budget nothing is timed

    monkeypatch.setenv("PARITY_BUDGET_SCALE", "fast")
    r = pytester.runpytest("--budget", "-q")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "PARITY_BUDGET_SCALE must be a positive number, not 'fast'" in r.stderr.str()


def test_the_reference_workload_runs_on_one_thread_and_leaves_the_process_as_it_was(
        monkeypatch):
    import torch
    monkeypatch.setattr(budgets, "REPEATS", 1)
    monkeypatch.setattr(budgets, "MIN_REPEATS", 1)
    threads = []
    workload = budgets.reference_workload
    monkeypatch.setattr(budgets, "reference_workload",
                        lambda t: threads.append(torch.get_num_threads()) or workload(t))
    from parity import cpu_bf16
    n, kernels = torch.get_num_threads(), cpu_bf16.active()
    torch.set_num_threads(2)
    try:
        measured = budgets.time_reference()
        assert torch.get_num_threads() == 2 and cpu_bf16.active() == kernels
    finally:
        torch.set_num_threads(n)
    assert threads == [1, 1] and 0 < measured < 60
