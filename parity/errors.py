"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, a reward function that misbehaves) is
raised as ParityError; the CLI prints its one-line message and exits with code 2, without a
traceback. Everything else is a bug in parity and keeps its traceback.
"""

import re

# Every character str.splitlines breaks a line at: a message quoting a path, a dataset value
# or a library's text may hold any of them.
_LINE_BREAKS = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


class ParityError(Exception):
    """A problem with the user's input, reported as one clear line (exit code 2). A line break
    inside the message is written as its escape (\\n), so the line stays one line."""

    def __init__(self, message: object = "") -> None:
        super().__init__(_LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], str(message)))


def one_line(e: BaseException) -> str:
    """`TypeName: first non-blank line of the message`, for wrapping a library's exception in a
    ParityError (its traceback and the rest of its message are noise to the user)."""
    text = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
