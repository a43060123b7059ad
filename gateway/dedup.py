"""The recently accepted events of this gateway, persisted so duplicates survive a restart.

An event is known by `(run_id, event_id)` (CONTRACT section 2): the same id in another run
is another event. Bound: the last `window` keys (config `dedup_window`, default 200,000;
about 40 MB). Older keys are forgotten, and a duplicate of one is published again; that is
still safe because the processor applies each key once, the gateway count is only a
courtesy.

Persistence is an append-only log of keys, one JSON array `[run_id, event_id]` per line
(ids may hold newlines), written after the broker acked them; at start the log's last
`window` lines are loaded, and it is rewritten to that tail once it holds twice the
window, so it never grows without bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import orjson

EventKey = tuple[str, str]  # (run_id, event_id)


class RecentIds:
    """A bounded, insertion-ordered set of event keys backed by a log file."""

    def __init__(self, path: Path, window: int):
        self.path = path
        self.window = window
        self._ids: OrderedDict[EventKey, None] = OrderedDict()
        self._in_flight: set[EventKey] = set()
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._logged = 0
        if path.exists():
            with path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        key = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue  # a line cut short by a crash mid-write
                    if not (isinstance(key, list) and len(key) == 2
                            and all(isinstance(part, str) for part in key)):
                        continue  # a bare id, logged before keys held the run
                    self._remember((key[0], key[1]))
                    self._logged += 1
        self._log = path.open("a", encoding="utf-8")

    def __len__(self) -> int:
        return len(self._ids)

    def claim(self, ids: Iterable[EventKey]) -> tuple[list[int], list[int]]:
        """Split keys into (new, duplicate) positions and reserve the new ones.

        A key repeated inside `ids`, already accepted, or being published by a concurrent
        request counts as a duplicate. Reserved keys must be settled with `commit` or
        `release`.
        """
        fresh: list[int] = []
        dups: list[int] = []
        with self._lock:
            for i, event_id in enumerate(ids):
                if event_id in self._ids or event_id in self._in_flight:
                    dups.append(i)
                else:
                    self._in_flight.add(event_id)
                    fresh.append(i)
        return fresh, dups

    def commit(self, ids: list[EventKey]) -> None:
        """The broker acked these ids: remember and log them."""
        with self._lock:
            self._in_flight.difference_update(ids)
            for event_id in ids:
                self._remember(event_id)
            self._log.write(_lines(ids))
            self._log.flush()
            self._logged += len(ids)
            if self._logged > 2 * self.window:
                self._compact()

    def release(self, ids: list[EventKey]) -> None:
        """Publishing failed: the ids may be sent again."""
        with self._lock:
            self._in_flight.difference_update(ids)

    def close(self) -> None:
        with self._lock:
            self._log.close()

    def _remember(self, event_id: EventKey) -> None:
        self._ids[event_id] = None
        self._ids.move_to_end(event_id)
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)

    def _compact(self) -> None:
        # Write the tail to a temporary file and rename it over the log: atomic on POSIX.
        self._log.close()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(_lines(self._ids), encoding="utf-8")
        tmp.replace(self.path)
        self._logged = len(self._ids)
        self._log = self.path.open("a", encoding="utf-8")


def _lines(ids: Iterable[EventKey]) -> str:
    return "".join(orjson.dumps(list(key)).decode() + "\n" for key in ids)
