"""Errors that reach the user: each says what is wrong and what to do, and the CLI prints it without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave us (a spec, a flag, a path). The message must name the fix."""

    exit_code = 2
