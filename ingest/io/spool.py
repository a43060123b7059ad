"""Kept groups' token columns handed from a group stage to the batch stage beside it
through files on this host, instead of through Kafka a second time.

A decision carries its group's fragments as Arrow IPC: for a kept group about 9 bytes per
response token, as many bytes as the events themselves. Through Kafka they cross the
broker and two kafka-python network threads again, about a fifth of the CPU of a
processor that reads a backlog on two cores. When the batch stage of the same processor
instance owns the run's decisions partition (it keeps the folder's `owned` file current),
the group stage writes a poll's fragments into one file of the instance's folder and each
decision goes out with an empty value and a reference (Kafka header `spool`) to its bytes.

The spool is a cache, never the record. A reference a batch stage cannot use (another
host or boot, a file removed for age or size, a partition taken over by another instance
meanwhile) is re-assembled from the `events` archive, which holds a group's events before
its decision is sent, as a decision too large to travel is. Files are written whole
before the decision that names them is sent, never change, and are removed only by the
writer, oldest first, past `KEEP_S` or `MAX_BYTES`; a batch stage that replays decisions
after a restart or take-over (up to a snapshot's worth) finds them while they are kept.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

log = logging.getLogger(__name__)

HEADER = "spool"
OWNED = "owned"  # JSON list of the decisions partitions the instance's batch stage owns
LOCK = "lock"  # held by the instance's parent process while it lives
KEEP_S = 300.0
MAX_BYTES = 1 << 30


@functools.cache  # read once per process: every spooled decision is checked against it
def boot_id() -> str | None:
    """This boot of this host (Linux), or None where the system does not say: a file of an
    earlier boot may have lost its last writes in a crash, so only this boot's are read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def default_root() -> Path:
    """One folder per user: another user's could not be written to."""
    return Path(tempfile.gettempdir()) / f"rolloutlake-spool-{os.getuid()}"


@dataclass(frozen=True, slots=True)
class SpoolRef:
    """Where one decision's fragments lie: `length` bytes at `offset` of `path`."""

    boot: str
    path: str
    offset: int
    length: int

    def header(self) -> tuple[str, bytes]:
        return (HEADER, orjson.dumps(asdict(self)))

    @classmethod
    def parse(cls, raw: bytes) -> SpoolRef:
        """The reference in a `spool` header; ValueError naming what is wrong."""
        try:
            fields = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise ValueError(f"spool header is not JSON ({err})") from None
        expected = {"boot": str, "path": str, "offset": int, "length": int}
        if not isinstance(fields, dict) or set(fields) != set(expected) or not all(
                type(fields[name]) is kind for name, kind in expected.items()):
            raise ValueError(f"spool header {raw[:200]!r} is not "
                             "{boot: str, path: str, offset: int, length: int}")
        if fields["offset"] < 0 or fields["length"] < 0:
            raise ValueError(f"spool header {raw[:200]!r} has a negative offset or length")
        return cls(**fields)

    def read(self) -> pa.Buffer | None:
        """The bytes (mapped, not copied), or None where this process cannot read them."""
        if self.boot != boot_id():
            return None
        try:
            mapped = pa.memory_map(self.path)
        except (OSError, pa.ArrowException):  # removed, or another host's folder
            return None
        with mapped:
            if mapped.size() < self.offset + self.length:
                return None
            mapped.seek(self.offset)
            return mapped.read_buffer(self.length)  # keeps the mapping while referenced


class DecisionSpool:
    """One processor instance's folder, shared by its group stage (which writes decisions'
    fragments there) and its batch stage (which says which decisions partitions it owns).

    `create` makes the folder in the parent process, which holds its lock and removes it
    on the way out (`remove`); the batch-stage child opens the same folder by its path.
    """

    def __init__(self, folder: Path, *, keep_s: float = KEEP_S, max_bytes: int = MAX_BYTES):
        self.folder = folder
        self.keep_s = keep_s
        self.max_bytes = max_bytes
        self._seq = 0
        self._written: deque[tuple[Path, float, int]] = deque()  # oldest first
        self._bytes = 0
        self._lock: int | None = None

    @classmethod
    def create(cls, root: Path | str | None = None) -> DecisionSpool | None:
        """A new instance folder under `root` (default: the system's temp folder), or None
        where this system names no boot (see `boot_id`). Expired files of instances that
        are gone are removed first."""
        if boot_id() is None:
            return None
        root = Path(root) if root is not None else default_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_expired(root, KEEP_S)
            folder = root / f"{os.getpid()}-{secrets.token_hex(4)}"
            folder.mkdir(mode=0o700)  # token ids and log-probs: the user's own
            lock = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as err:  # the decisions carry their fragments, as without a spool
            log.warning("no spool in %s (%s): decisions carry their fragments through Kafka",
                        root, err)
            return None
        fcntl.flock(lock, fcntl.LOCK_EX)
        spool = cls(folder)
        spool._lock = lock
        return spool

    def remove(self) -> None:
        """Remove the folder (the parent, once its stages are stopped)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    # -- the batch stage --------------------------------------------------------------------

    def own(self, partitions: set[int]) -> None:
        """Say which decisions partitions the batch stage owns now."""
        staged = self.folder / f"{OWNED}.{os.getpid()}"
        try:
            staged.write_bytes(orjson.dumps(sorted(partitions)))
            os.replace(staged, self.folder / OWNED)
        except OSError as err:  # the parent removed the folder on its way out, a full disk
            log.info("spool %s: cannot say the owned partitions (%s)", self.folder, err)

    # -- the group stage --------------------------------------------------------------------

    def owned(self) -> frozenset[int]:
        """The decisions partitions the instance's batch stage said it owns last (read
        each time: a few bytes, where a cache by modification time would miss a change
        within the file system's clock tick)."""
        try:
            return frozenset(orjson.loads((self.folder / OWNED).read_bytes()))
        except FileNotFoundError:  # not joined yet, or the folder was removed
            return frozenset()

    def carry(self, values: list[bytes], partitions: list[int]) -> list[SpoolRef | None]:
        """Write the values bound for partitions the batch stage owns into one new file;
        their references, None for the others (sent in Kafka as before)."""
        owned = self.owned()
        chosen = [i for i, (v, p) in enumerate(zip(values, partitions, strict=True))
                  if v and p in owned]
        refs: list[SpoolRef | None] = [None] * len(values)
        boot = boot_id()
        if not chosen or boot is None:
            return refs
        self._seq += 1
        path = self.folder / f"{self._seq:012d}.arrow"
        offset = 0
        try:
            with open(path, "wb") as file:
                for i in chosen:
                    file.write(values[i])
                    refs[i] = SpoolRef(boot, str(path), offset, len(values[i]))
                    offset += len(values[i])
        except OSError as err:  # a full disk: the decisions carry their fragments
            log.warning("spool %s: cannot write (%s); decisions carry their fragments", path, err)
            path.unlink(missing_ok=True)
            return [None] * len(values)
        self._written.append((path, time.monotonic(), offset))
        self._bytes += offset
        self._expire()
        return refs

    def _expire(self) -> None:
        """Remove the oldest files past the age or size the spool keeps."""
        now = time.monotonic()
        while self._written and (self._bytes > self.max_bytes
                                 or now - self._written[0][1] > self.keep_s):
            path, _, size = self._written.popleft()
            self._bytes -= size
            path.unlink(missing_ok=True)


def spooled_value(record: Any) -> tuple[bytes | pa.Buffer | None, str | None]:
    """A decisions record's fragments: its value, or the spool's bytes its `spool` header
    names; where those cannot be read here, None and why (the batch stage re-assembles
    the group from the archive)."""
    raw = next((value for key, value in record.headers or () if key == HEADER), None)
    if raw is None:
        return record.value, None
    try:
        ref = SpoolRef.parse(raw)
    except ValueError as err:
        return None, str(err)
    value = ref.read()
    return value, None if value is not None else f"not in this host's spool ({ref.path})"


def remove_expired(root: Path, keep_s: float) -> None:
    """Remove the files older than `keep_s` of instance folders under `root` whose
    process is gone (its lock is free), and such folders once they hold nothing else."""
    now = time.time()
    for folder in root.iterdir():
        lock = folder / LOCK
        try:
            held = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # not an instance folder, or one being made
        try:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its instance still runs
            left = False
            for file in folder.iterdir():
                try:
                    if file.name != LOCK and now - file.stat().st_mtime > keep_s:
                        file.unlink()
                    elif file.name != LOCK:
                        left = True
                except FileNotFoundError:  # another instance's start removed it
                    pass
            if not left:
                shutil.rmtree(folder, ignore_errors=True)
                log.info("removed the spool folder %s of a processor that is gone", folder)
        finally:
            os.close(held)
