"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, a reward function that misbehaves) is
raised as ParityError; the CLI prints its one-line message and exits with code 2, without a
traceback. Everything else is a bug in parity and keeps its traceback.
"""


class ParityError(Exception):
    """A problem with the user's input, reported as one clear line (exit code 2)."""
