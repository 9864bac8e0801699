"""The fast tier stays fast: tests/conftest.py refuses to collect a test that asks for a
fixture that builds or loads a model without the e2e mark, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_a_test_that_builds_a_model_without_the_e2e_mark_is_refused(pytester, monkeypatch):
    # no third-party plugins in the inner runs: hypothesis' alone costs seconds each time
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: end to end\n")
    pytester.makepyfile(test_models="""
        import pytest

        @pytest.fixture
        def run(arith_model):
            return arith_model

        def test_direct(text_model):
            pass

        def test_through_a_fixture(run):
            pass

        @pytest.mark.e2e
        def test_marked(text_model):
            pass

        def test_without_a_model(cache):
            pass
        """)
    r = pytester.runpytest("--collect-only", "-q")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert "test_models.py::test_direct (asks for text_model)" in err
    assert "test_models.py::test_through_a_fixture (asks for arith_model)" in err
    assert "test_marked" not in err and "test_without_a_model" not in err

    pytester.makepyfile(test_models="""
        import pytest

        pytestmark = pytest.mark.e2e

        def test_direct(text_model):
            pass
        """)
    r = pytester.runpytest("--collect-only", "-q")
    assert r.ret == pytest.ExitCode.OK, r.stderr.str()
    r = pytester.runpytest("--collect-only", "-q", "-m", "not e2e")
    assert r.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # the marked test is deselected



def test_a_test_over_its_budget_fails_under_budget_and_only_there(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST.replace("DEFAULT_BUDGET_S = 30.0", "DEFAULT_BUDGET_S = 0.05"))
    pytester.makeini("[pytest]\nmarkers =\n    e2e: end to end\n    slow: long\n"
                     "    budget(seconds): budget\n")
    pytester.makepyfile(test_times="""
        import time
        import pytest

        @pytest.fixture
        def slow_setup():
            time.sleep(0.15)   # set-up is not the test's own call

        def test_over(slow_setup):
            time.sleep(0.15)

        def test_within(slow_setup):
            pass

        @pytest.mark.budget(5)
        def test_raised():
            time.sleep(0.15)

        @pytest.mark.slow
        def test_slow_ones_are_not_budgeted():
            time.sleep(0.15)
        """)
    r = pytester.runpytest("--budget", "--runslow", "-q")
    r.assert_outcomes(passed=3, failed=1)
    out = r.stdout.str()
    assert "test_over took 0.2 s, over its budget of 0.05 s" in out, out
    pytester.runpytest("--runslow", "-q").assert_outcomes(passed=4)
