"""The one exception type users see: its message names the problem and the fix."""


class KilnError(Exception):
    """A user-facing error; the CLI prints its message as one line, without a traceback."""
