"""Children that die with the process that started them, however it ends.

`dynabatch run` stops its children in order when it ends normally or on Ctrl-C.
When it cannot (SIGKILL, the OOM killer, a crash of the interpreter) its children,
each in a session of its own so that a terminal's Ctrl-C does not reach them,
would live on for ever, holding their ports and checkpointing into the run folder.
On Linux the kernel's parent-death signal (prctl PR_SET_PDEATHSIG) sends them
SIGTERM, the signal they already stop cleanly on. Elsewhere nothing is set up:
the orderly stop still applies, only a parent killed outright leaves them behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent (the child between fork and exec loads nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this process ends (None where unsupported).

    The signal follows the thread that forks: call it from a thread that lives as long as
    the children (the main thread of `dynabatch run`).
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()
    return lambda: arm_parent_death(parent)


def arm_parent_death(parent: int) -> None:
    """In a child of `parent`: SIGTERM when it ends. A parent that died before this call (between the fork and
    now) is noticed by the child's parent id having changed."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
