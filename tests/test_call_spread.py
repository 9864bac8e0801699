"""scripts/call_spread.py: the spread of one test's time between two runs, from JUnit files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("call_spread", ROOT / "scripts/call_spread.py")
call_spread = importlib.util.module_from_spec(spec)
spec.loader.exec_module(call_spread)


def _junit(path: Path, times: dict[str, float]) -> str:
    cases = "".join(f'<testcase classname="tests.m" name="{n}" time="{t}"/>'
                    for n, t in times.items())
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return str(path)


def test_the_ratios_are_longer_over_shorter_for_tests_long_in_both_runs(tmp_path, capsys):
    a = _junit(tmp_path / "a.xml", {"t1": 10.0, "t2": 20.0, "t3": 6.0, "short": 1.0, "only_a": 50})
    b = _junit(tmp_path / "b.xml", {"t1": 12.5, "t2": 10.0, "t3": 6.0, "short": 9.0, "only_b": 50})
    rows = call_spread.spread(call_spread.times(a), call_spread.times(b), min_s=5)
    assert rows == [(2.0, "tests.m::t2"), (1.25, "tests.m::t1"), (1.0, "tests.m::t3")]
    assert call_spread.main([a, b, "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("3 tests of at least 5 s in both runs: longer / shorter median 1.25, "
                      "90th percentile 1.85, 95th 1.93, largest 2.00"), out
    assert out[1].split() == ["2.00", "20.0", "s", "10.0", "s", "tests.m::t2"]


def test_too_few_tests_or_an_unreadable_file_is_one_line(tmp_path, capsys):
    a = _junit(tmp_path / "a.xml", {"t1": 10.0})
    assert call_spread.main([a, a]) == 1
    assert "1 tests took at least 5 s in both runs; too few" in capsys.readouterr().err
    (tmp_path / "bad.xml").write_text("<testsuites>")
    with pytest.raises(SystemExit, match=r"call_spread: cannot read .*bad\.xml"):
        call_spread.main([a, str(tmp_path / "bad.xml")])
