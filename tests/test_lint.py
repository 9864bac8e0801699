"""The repository passes its own linter: `ruff check` with pyproject.toml's [tool.ruff] rules
(ruff is in the `test` extra, so CI has it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    # --no-cache: the suite writes nothing into the checkout
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                        "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0:
        pytest.fail("`ruff check` found problems (`ruff check --fix` mends those marked [*]):\n"
                    + p.stdout + p.stderr, pytrace=False)
