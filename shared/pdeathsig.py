"""A child process that dies with its parent: the kernel sends it SIGTERM when the process that
started it dies, even by SIGKILL (PR_SET_PDEATHSIG, Linux; elsewhere a no-op). A child in a
session of its own would otherwise outlive a killed parent (and hold its port, or the GPU).

Used by `tokenfleet.supervise` (its `die_with_parent` option, as a Popen preexec_fn) and by the
gateway's worker processes (first thing in the child)."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: a preexec_fn runs between fork and exec, no place to load a library.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """Ask for SIGTERM when this process's parent dies; run in the child."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
