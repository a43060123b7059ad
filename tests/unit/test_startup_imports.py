"""What `rolloutlake process` loads before it parses its flags.

The CLI starts the batch-stage child before the parse (ingest/processor/launch.py), so
the child imports the heavy modules while the parent's parse imports the same; that only
overlaps if the CLI and the launcher themselves import none of them.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "pyarrow", "pydantic", "kafka", "deltalake")


def test_the_cli_and_the_launcher_import_nothing_heavy():
    probe = ("import sys, ingest.cli, ingest.processor.launch; "
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""
