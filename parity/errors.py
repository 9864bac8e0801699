"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, a reward function that misbehaves) is
raised as ParityError; the CLI prints its one-line message and exits with code 2, without a
traceback. Everything else is a bug in parity and keeps its traceback.
"""


class ParityError(Exception):
    """A problem with the user's input, reported as one clear line (exit code 2)."""


def one_line(e: BaseException) -> str:
    """`TypeName: first line of the message`, for wrapping a library's exception in a
    ParityError (its traceback and the rest of its message are noise to the user)."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
