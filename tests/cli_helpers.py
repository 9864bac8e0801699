"""Assertions shared by the tests that run the CLI as a user would."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

# A run of the smallest testbed model that takes seconds a step: for the tests that run the CLI
# in its own process to fault or resume it.
TINY_RUN = ["--model", "text-xs", "--prompts-per-step", "2", "--samples-per-prompt", "4",
            "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--report-to", "none"]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`parity ARGS` in its own process, its output captured."""
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True,
                          text=True, timeout=timeout)


def run_main(*args: str) -> subprocess.CompletedProcess:
    """`parity ARGS` through its real entry point in this process, as a CompletedProcess: no
    interpreter start and no 3-4 s of imports. For refusals and short runs; `cli` is for what
    needs a process of its own (signals, kills, locks between processes, what a library writes
    to the real stderr)."""
    from parity.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


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
