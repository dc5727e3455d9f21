"""The C allocator setting of the command-line entry points (no torch import: ``--help`` stays fast)."""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Let glibc keep large freed blocks for reuse instead of unmapping them.

    glibc serves every block above its mmap threshold (at most 32 MB) with fresh pages from
    the kernel and gives them back on ``free``, so each large temporary of a batch (the
    captured attention: 200 MB for 8 images at 448 px) is paid again in page faults, about
    0.6 ms per MB on the development machine. ``segment``, ``segment-eval`` and the
    benchmarks call this first; the process then holds on to its peak memory until it exits.

    Nothing is changed when the environment already tunes the allocator
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) or when
    the C library is not glibc.

    Returns:
        Whether the thresholds were set.
    """
    if any(os.environ.get(k) for k in _ALLOCATOR_ENV) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
                    and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)))
    except (OSError, AttributeError):
        return False
