"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL the calling process when its parent dies.

    Call it first thing in the child (or as a `preexec_fn`). The signal follows the parent
    *thread* that started the child, so start children from a thread that outlives them.
    A parent that died before the prctl is caught by the getppid check.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
