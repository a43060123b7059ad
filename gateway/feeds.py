"""Live feeds of a run for the event streams and the dashboard: sealed steps with their
metrics, group decisions, response lengths.

One `RunFeed` per run tails the lake (`ingest.io.tail`) on a single polling task shared by
every viewer of the run, and keeps each event already encoded as a server-sent event, so a
hundred viewers cost one Delta version check per poll and a list slice each. A feed is
rebuilt from Delta after a restart, so step ids (the step number) resume exactly.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import datetime

import numpy as np
import orjson
import pyarrow as pa

from ingest.io.lake import Lake
from ingest.io.tail import SealedStep, StepTail, TableTail

log = logging.getLogger(__name__)

POLL_S = 0.25  # Delta version check interval while someone watches; the update latency floor
GROUP_BACKLOG = 50  # group decisions sent on a fresh connection (the page shows the latest)
LENGTH_CLASSES = ("kept", "dropped", "cancelled")


def _sse(event: str, event_id: str, data: dict) -> bytes:
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (event_id.encode(), event.encode(), orjson.dumps(data))


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _group_key(decided_at: datetime, group_index: int) -> tuple[int, int]:
    return int(decided_at.timestamp() * 1_000_000), group_index


class RunFeed:
    """Everything streamed for one run, appended as the lake grows."""

    def __init__(self, lake: Lake, run_id: str):
        self.run_id = run_id
        self.steps: list[int] = []  # step numbers, in the order they were appended
        self.step_events: list[bytes] = []
        self.group_keys: list[tuple[int, int]] = []  # (decided_at micros, group_index)
        self.group_events: list[bytes] = []
        self._group_position: dict[tuple[int, int], int] = {}
        # Response lengths per sample row, in chunks: step, class (index in LENGTH_CLASSES).
        self._length_chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._step_tail = StepTail(lake, run_id)
        self._group_tail = TableTail(
            lake, "groups", run_id,
            ["group_index", "step", "n_samples", "decision", "reason", "batch_step",
             "decided_at", "mean_reward"],
        )
        self._sample_tail = TableTail(
            lake, "samples", run_id, ["step", "decision", "reason", "response_length"]
        )
        self.changed = asyncio.Event()
        self._poll_lock = asyncio.Lock()
        self.listeners = 0
        self._task: asyncio.Task | None = None

    # -- polling (runs in a worker thread; only builds new values) --------------------

    def _read(self) -> tuple[list[SealedStep], pa.Table | None, pa.Table | None]:
        return self._step_tail.poll(), self._group_tail.poll(), self._sample_tail.poll()

    def _apply(self, sealed: list[SealedStep], groups: pa.Table | None,
               samples: pa.Table | None) -> bool:
        for s in sealed:
            self.steps.append(s.step)
            self.step_events.append(_sse("step", str(s.step), {
                "run_id": self.run_id, "step": s.step, "sealed_at": _iso(s.sealed_at),
                "n_groups": s.n_groups, "n_samples": s.n_samples, "metrics": s.metrics,
            }))
        if groups is not None and groups.num_rows:
            rows = sorted(groups.to_pylist(), key=lambda r: (r["decided_at"], r["group_index"]))
            for row in rows:
                key = _group_key(row["decided_at"], row["group_index"])
                self._group_position[key] = len(self.group_keys)
                self.group_keys.append(key)
                row["decided_at"] = _iso(row["decided_at"])
                self.group_events.append(
                    _sse("group", f"{key[0]}.{key[1]}", {"run_id": self.run_id, **row})
                )
        if samples is not None and samples.num_rows:
            decision = samples["decision"].to_numpy(zero_copy_only=False)
            reason = samples["reason"].to_numpy(zero_copy_only=False)
            cls = np.where(decision == "kept", 0, np.where(reason == "cancelled_at_seal", 2, 1))
            self._length_chunks.append((
                samples["step"].fill_null(-1).to_numpy(),
                cls.astype(np.int8),
                samples["response_length"].to_numpy(),
            ))
        return bool(sealed) or groups is not None or samples is not None

    async def poll_once(self) -> None:
        # The tails are not thread-safe: one read at a time, even when a new viewer's
        # first poll meets the shared poller.
        async with self._poll_lock:
            grew = self._apply(*await asyncio.to_thread(self._read))
        if grew:
            # Wake every waiting viewer; later waiters take the fresh event.
            woken, self.changed = self.changed, asyncio.Event()
            woken.set()

    async def _poll_while_watched(self) -> None:
        failing = None  # the failure logged last, until a poll works again
        while self.listeners:
            try:
                await self.poll_once()
            except Exception as err:  # a transient lake error must not end every viewer's stream
                # Logged once per cause: the polls retry four times a second.
                if repr(err) != failing:
                    log.exception("polling run %s failed; retrying every %g s", self.run_id,
                                  POLL_S)
                    failing = repr(err)
            else:
                if failing is not None:
                    log.info("polling run %s works again", self.run_id)
                    failing = None
            await asyncio.sleep(POLL_S)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[RunFeed]:
        """Keep the shared poller running while the caller streams."""
        self.listeners += 1
        if self._task is None or self._task.done():
            await self.poll_once()
            self._task = asyncio.create_task(self._poll_while_watched())
        try:
            yield self
        finally:
            self.listeners -= 1

    # -- reading -----------------------------------------------------------------------

    def step_position_after(self, last_step: int | None) -> int:
        if last_step is None:
            return 0
        # Steps are appended in step order (StepTail), so bisect finds the resume point.
        return bisect.bisect_right(self.steps, last_step)

    def group_position_after(self, cursor: tuple[int, int] | None) -> int:
        if cursor is None:
            return max(0, len(self.group_keys) - GROUP_BACKLOG)
        if cursor in self._group_position:
            return self._group_position[cursor] + 1
        # An id this feed never sent: resume at the first later decision.
        return next((i for i, k in enumerate(self.group_keys) if k > cursor), len(self.group_keys))

    def response_lengths(self, last_steps: int | None, bins: int) -> dict:
        """Histogram of response lengths per class over the whole run or its last steps."""
        if not self._length_chunks:
            return {"edges": [], "counts": {c: [] for c in LENGTH_CLASSES},
                    "mean": {}, "n": {c: 0 for c in LENGTH_CLASSES}}
        step, cls, length = (np.concatenate(parts) for parts in zip(*self._length_chunks, strict=True))
        if last_steps is not None and self.steps:
            keep = step > max(self.steps) - last_steps
            cls, length = cls[keep], length[keep]
        top = max(int(length.max(initial=0)), 1)
        edges = np.linspace(0, top, bins + 1)
        out: dict = {"edges": edges.round(1).tolist(), "counts": {}, "mean": {}, "n": {}}
        for i, name in enumerate(LENGTH_CLASSES):
            values = length[cls == i]
            out["counts"][name] = np.histogram(values, bins=edges)[0].tolist()
            out["n"][name] = int(values.size)
            if values.size:
                out["mean"][name] = float(values.mean())
        return out


class Feeds:
    """The feeds of one gateway process, one per run, created on a run's first viewer and
    kept after the last one leaves, so a reconnect does not re-read the run."""

    def __init__(self, lake: Lake):
        self.lake = lake
        self._feeds: dict[str, RunFeed] = {}

    def get(self, run_id: str) -> RunFeed:
        feed = self._feeds.get(run_id)
        if feed is None:
            feed = self._feeds[run_id] = RunFeed(self.lake, run_id)
        return feed
