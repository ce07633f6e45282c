"""Child processes that must not outlive what started them.

Engines, routers and benchmark clients run in sessions of their own (`start_new_session=True`), so that a signal to
their starter's process group does not reach them before the starter has stopped them in order. The price is that
nothing stops them when the starter dies outright (SIGKILL at the end of Slurm's KillWait, an OOM kill, a requeue):
they are reparented to init, and Slurm's `proctrack/linuxproc` and `proctrack/pgid` lose track of them. The parent-
death signal closes that gap: the kernel sends it to the child when its parent exits, however it exits.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: no logging, no exceptions out.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> Callable[[], None] | None:
    """`preexec_fn` for subprocess.Popen: the child gets SIGTERM when its parent dies (Linux; None elsewhere).

    The signal follows the thread that forked the child: start children from the thread that lives as long as
    they should (the main thread, here)."""
    return _die_with_parent if sys.platform == "linux" else None
