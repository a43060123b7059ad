"""What every `rolloutlake` command loads before it parses its flags: nothing heavy, so
a command pays only for the modules it uses."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "pyarrow", "pydantic", "kafka", "deltalake")


def test_the_cli_imports_nothing_heavy():
    probe = ("import sys, ingest.cli; "
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""
