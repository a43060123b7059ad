"""A bench's scratch folder: removed when the bench exits. The benches write lakes of
gigabytes (the pipeline bench 1-2 GB a run); left behind, a few runs filled the disk."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_folder(prefix: str) -> Path:
    """A new folder under the system's temporary folder, removed at exit (also an early
    one, or one by an error)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
