"""The processor's allocator settings (ingest/io/allocator.py), each in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

# Page faults of 200 buffers of 256 KiB to 9 MiB, a few alive at a time, as kafka-python's
# fetch responses and the record batches decompressed from them are.
FAULTS = """
import random, resource, sys
from ingest.io.allocator import reuse_large_buffers
if sys.argv[1] == "tuned":
    assert reuse_large_buffers()
sizes = random.Random(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
alive = []
for _ in range(200):
    alive.append(bytearray(sizes.randrange(256 * 1024, 9 * 2**20)))
    if len(alive) > 3:
        alive.pop(0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_freed_megabyte_buffers_are_reused_instead_of_faulted_in_again():
    default, tuned = _faults("default"), _faults("tuned")
    assert default > 50_000  # 4 KiB pages: a fresh mapping for most buffers
    assert tuned < default / 4  # freed heap kept, and its pages served again
