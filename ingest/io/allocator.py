"""glibc's allocator, tuned for a process that passes megabyte buffers by the thousand.

Every Kafka fetch response (up to 9 MiB), every lz4-decompressed record batch and every
token column of a group is a buffer of a megabyte or more, allocated and freed within
milliseconds. glibc serves allocations over its mmap threshold (128 KiB at first, raised
as such buffers are freed, never past 32 MiB) with a fresh mmap, and returns heap memory
over its trim threshold to the kernel: such a buffer is zero pages faulted in, one 4 KiB
page at a time, each time. Reading the 122 MiB compact bench stream with kafka-python:
0.53-0.58 CPU s by default, 0.35-0.39 s with the thresholds below, four runs each
(setting only one of them is slower than either: it switches off the other's adjustment).

The cost is memory kept: up to TRIM_THRESHOLD_BYTES of freed heap stays with the process
for reuse instead of going back to the kernel.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest dynamic threshold on 64-bit
TRIM_THRESHOLD_BYTES = 64 * 2**20


def reuse_large_buffers() -> bool:
    """Serve buffers under 32 MiB from the heap and keep up to 64 MiB of it freed for
    reuse. Returns whether the allocator took the settings (False off glibc)."""
    if platform.libc_ver()[0] != "glibc":  # musl, macOS: other allocators, other knobs
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
