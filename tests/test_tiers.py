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
