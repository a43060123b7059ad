"""What `rolloutlake process` loads before it parses its flags.

The CLI starts the batch-stage child before the parse (ingest/processor/launch.py), so
the child imports the heavy modules while the parent's parse imports the same; that only
overlaps if the CLI and the launcher themselves import none of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("numpy", "pyarrow", "pydantic", "kafka", "deltalake")


def test_the_cli_and_the_launcher_import_nothing_heavy():
    probe = ("import sys, ingest.cli, ingest.processor.launch; "
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""


def _bytecode_matches(source: Path, cached: Path) -> bool:
    """The check an import makes of a timestamp-based .pyc: source mtime and size."""
    if not cached.exists():
        return False
    header = cached.read_bytes()[:16]
    stat = source.stat()
    return (int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF)


def test_the_processor_starts_from_bytecode():
    """Every module of this checkout that the processor imports has bytecode matching its
    source, so no start compiles it again, even where PYTHONDONTWRITEBYTECODE keeps imports
    from writing any (`make bytecode`, a step of `make test` and `make demo`)."""
    probe = ("import sys, ingest.processor.command, ingest.processor.main; "
             "print('\\n'.join(f'{m.__spec__.origin} {m.__spec__.cached}' "
             "for m in list(sys.modules.values()) "
             "if getattr(m, '__spec__', None) and m.__spec__.has_location "
             "and m.__spec__.cached and m.__spec__.origin.startswith(tuple(sys.argv[1:]))))")
    root = Path(__file__).resolve().parents[2]
    packages = [f"{root / name}/" for name in ("schemas", "ingest", "gateway", "trainer")]
    result = subprocess.run([sys.executable, "-c", probe, *packages], capture_output=True,
                            text=True, check=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    modules = [line.split(" ") for line in result.stdout.splitlines()]
    assert len(modules) > 20  # the processor's own modules
    stale = [source for source, cached in modules
             if not _bytecode_matches(Path(source), Path(cached))]
    assert stale == [], "run `make bytecode`"
