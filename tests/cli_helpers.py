"""Assertions shared by the tests that run the CLI as a user would."""

from __future__ import annotations

import subprocess


def assert_user_error(p: subprocess.CompletedProcess, *words: str) -> str:
    """A refused command: exit 2, no traceback, exactly one `parity: error:` line naming
    `words`; returns that line."""
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("parity: error:")]
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]
