"""How much the same test's time differs between two runs of the suite, from their JUnit files:
the figure behind `pytest --budget`'s tolerance (tests/conftest.py, TOLERANCE; CONTRIBUTING.md,
"Test time").

    PYTEST_ADDOPTS="--junitxml=/tmp/a.xml" bash .ci/run   # and again into /tmp/b.xml
    python scripts/call_spread.py /tmp/a.xml /tmp/b.xml [--min-s 5] [--top 5]

For each test in both files that took at least --min-s seconds in each, the ratio of its longer
time to its shorter; it prints their count, median, 90th and 95th percentiles and largest, then
the tests with the largest ratios. A JUnit time holds the test's set-up too, and a shared engine
or server starts in whichever test of a worker asks first, which can be another test in the
other run: the spread of the calls alone, which the budgets time, is at most this.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import xml.etree.ElementTree as ET


def times(path: str) -> dict[str, float]:
    """Each test's time in a JUnit file (pytest's: set-up, call and teardown together)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"call_spread: cannot read {path}: {e}") from None
    return {f"{case.get('classname')}::{case.get('name')}": float(case.get("time", 0))
            for case in root.iter("testcase")}


def spread(a: dict[str, float], b: dict[str, float], min_s: float) -> list[tuple[float, str]]:
    """(longer / shorter, test) for the tests in both runs that took at least min_s in each,
    largest first."""
    both = [(max(a[k], b[k]) / min(a[k], b[k]), k) for k in a.keys() & b.keys()
            if min(a[k], b[k]) >= min_s]
    return sorted(both, reverse=True)


def quantile(sorted_values: list[float], q: float) -> float:
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--min-s", type=float, default=5.0,
                        help="leave out tests shorter than this in either run (default 5)")
    parser.add_argument("--top", type=int, default=5, help="tests to list (default 5)")
    args = parser.parse_args(argv)
    a, b = times(args.first), times(args.second)
    rows = spread(a, b, args.min_s)
    if len(rows) < 2:
        print(f"call_spread: {len(rows)} tests took at least {args.min_s:g} s in both runs; "
              f"too few to say anything", file=sys.stderr)
        return 1
    ratios = sorted(r for r, _ in rows)
    print(f"{len(rows)} tests of at least {args.min_s:g} s in both runs: longer / shorter "
          f"median {statistics.median(ratios):.2f}, 90th percentile {quantile(ratios, 0.9):.2f}, "
          f"95th {quantile(ratios, 0.95):.2f}, largest {ratios[-1]:.2f}")
    for ratio, test in rows[:args.top]:
        print(f"  {ratio:5.2f}  {a[test]:7.1f} s  {b[test]:7.1f} s  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
