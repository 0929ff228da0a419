"""The one base class of every stage's user-facing error.

A :class:`StageError` is bad input or a refused condition: its message names the file, key
or row at fault and is all the user needs (the rule adapter and the ``hy3rl`` CLI print it
without a traceback and exit 1). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class StageError(Exception):
    """A stage stopped on bad input or a refused condition; the message says what and where."""
