"""`PromptService`: the next N prompt groups of a run's dataset, with a durable cursor.

The order is `gateway.prompts.cursor.take`'s; `seed` is the run config's `rollout_seed`
(default 42). Errors are `schemas.errors` domain errors (the app maps them to HTTP).

Durability: the acknowledged `group_started` events on the events topic are the cursor's
write-ahead log; the Delta table `prompt_cursor` is a checkpoint of it.

- Request path (on the event loop, no thread hop once a run is warm): requests for one
  run queue up and one task per run drains the queue in order (group commit): for all
  queued serves at once it advances a copy of the in-memory cursor, publishes the groups'
  `group_started` events (deterministic ids `{run}/group_started/{index}`), awaits every
  ack (acks=all), and only then adopts the new cursor and answers. Recycling and the
  first use of a run (restore) go through the same queue, in a worker thread. A
  failed publish leaves the cursor where it was, so the retry re-issues the same indices
  and event ids (the processor applies each id once). Hence the groups handed out are
  always a gap-free prefix `0..next_group_index-1`, each one's event acknowledged.
- Checkpoints: a background thread appends the cursor (with the groups issued since the
  previous checkpoint, and in `prompt_cursor_wal` the events-topic offsets where a
  roll-forward may start) every `prompt_checkpoint_groups` groups or
  `prompt_checkpoint_interval_s` seconds, and once more at graceful shutdown. Recycling
  and a run's first serve (which pins the dataset version and seed) checkpoint
  synchronously, because the log does not record them.
- Partial rollout: a recycle may carry what the groups' samples had generated; those
  rows are appended to `recycled_samples` before the checkpoint that queues the groups,
  kept in memory while the groups wait, reloaded by a restore, and handed out with each
  group's next serve.
- Restore (first use of a run in a process): load the last checkpoint, read the run's
  `group_started` events after it, and replay `take` up to the first index missing from
  the log. Groups past such a gap belong to a failed batch that nobody received; they are
  issued again. The replayed rows are checked against the rows the events name.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from starlette.concurrency import run_in_threadpool

from gateway.datasets import DATASET_NAME, DatasetStore
from gateway.producer import GatewayProducer
from gateway.prompts.checkpoints import CursorCheckpoints, RecycledSamples
from gateway.prompts.cursor import Cursor, Issued, roll_forward, take
from gateway.prompts.wal import read_group_log
from gateway.runs import RunInfo, RunRegistry
from ingest.io.kafka import Record
from ingest.io.lake import Lake
from ingest.sdk.publisher import event_record
from schemas.errors import ConflictError, NotFoundError
from schemas.events import parse_event

log = logging.getLogger(__name__)

DEFAULT_SEED = 42
# A run's config (from the runs topic) and its number of sealed steps (the default `step`,
# from Delta) are re-read in the background once older than this; requests never wait for
# that I/O after a run's first request. A new `n_samples_per_prompt` or a newly sealed
# step therefore applies within about this long.
RUN_INFO_TTL_S = 1.0
STEPS_TTL_S = 0.25


class _Cached:
    """A value re-read in a background thread once older than `ttl_s`: the first read
    loads synchronously (None is not kept), later reads return at once."""

    def __init__(self, load: Callable[[], Any], ttl_s: float):
        self._load = load
        self._ttl_s = ttl_s
        self._value: Any = None
        self._at = 0.0
        self._refreshing = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._value is not None

    def get(self) -> Any:
        if self._value is None:
            self._value, self._at = self._load(), time.monotonic()
        elif time.monotonic() - self._at > self._ttl_s and self._refreshing.acquire(blocking=False):
            threading.Thread(target=self._refresh, daemon=True).start()
        return self._value

    def _refresh(self) -> None:
        try:
            value = self._load()
            if value is not None:
                self._value = value
            self._at = time.monotonic()
        except Exception as err:  # keep serving the last value; the next read retries
            log.warning("background refresh failed: %s", err)
        finally:
            self._refreshing.release()


@dataclass
class _Request:
    """One caller waiting in a run's queue."""

    kind: Literal["serve", "recycle", "cursor"]
    future: asyncio.Future[dict[str, Any]]
    count: int = 0
    step: int | None = None
    groups: list[int] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Prepared:
    after: Cursor
    records: list[Record]
    answers: list[tuple[_Request, list[dict[str, Any]]]]
    issued: list[tuple[int, int]]
    resumed: list[int]  # recycled groups served again: their samples are handed out


@dataclass
class _RunState:
    # The run's drain task is the only writer of the cursor; `lock` makes each change
    # atomic for the checkpoint thread, whose `checkpoint_lock` serialises checkpoint
    # writers and is always taken before `lock`, never while holding it.
    lock: threading.Lock = field(default_factory=threading.Lock)
    checkpoint_lock: threading.Lock = field(default_factory=threading.Lock)
    queue: list[_Request] = field(default_factory=list)
    draining: bool = False
    cursor: Cursor | None = None  # acknowledged state; None until restored
    rows: pa.Table | None = None  # the dataset version being served
    saved: Cursor | None = None  # the last checkpoint
    saved_at: float = 0.0
    unsaved: list[tuple[int, int]] = field(default_factory=list)  # (group, row) since `saved`
    recent_rows: dict[int, int] = field(default_factory=dict)  # group -> row, since restore
    past_rows: dict[int, int] | None = None  # group -> row of checkpointed groups (lazy)
    wal_offsets: dict[int, int] = field(default_factory=dict)  # partition -> scan start
    # recycled group waiting to be served again -> its samples' partial rollouts
    recycled: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    fenced: bool = False  # another writer moved the cursor: reload before serving
    info: _Cached | None = None
    steps: _Cached | None = None


class PromptService:
    """Serves prompt groups for every run; one `_RunState` per run."""

    def __init__(self, lake: Lake, datasets: DatasetStore, runs: RunRegistry,
                 producer: GatewayProducer, *, checkpoint_groups: int = 1000,
                 checkpoint_interval_s: float = 5.0):
        self.lake = lake
        self.datasets = datasets
        self.runs = runs
        self.producer = producer
        self.checkpoints = CursorCheckpoints(lake, producer.topics.events)
        self.recycled_samples = RecycledSamples(lake)
        self.checkpoint_groups = checkpoint_groups
        self.checkpoint_interval_s = checkpoint_interval_s
        self._states: dict[str, _RunState] = {}
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._checkpoint_loop,
                                        name="prompt-checkpoints", daemon=True)
        self._thread.start()

    async def serve(self, run_id: str, count: int, step: int | None) -> dict[str, Any]:
        return await self._submit(run_id, "serve", count=count, step=step)

    async def recycle(self, run_id: str, group_indices: list[int],
                      samples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Append issued groups to the recycle FIFO, with their samples' partial rollouts
        (`RecycledSample`s); durable (a checkpoint) before it returns."""
        return await self._submit(run_id, "recycle", groups=group_indices,
                                  samples=samples or [])

    async def cursor(self, run_id: str) -> dict[str, Any]:
        return await self._submit(run_id, "cursor")

    def checkpoint(self, run_id: str) -> None:
        """Write the run's cursor to Delta if it moved since the last checkpoint."""
        state = self._state(run_id)
        with state.checkpoint_lock:
            with state.lock:
                if state.cursor is None or state.fenced:
                    return
                if not state.unsaved and state.saved is not None and \
                        replace(state.cursor, seq=state.saved.seq) == state.saved:
                    return
                cursor, issued = state.cursor, list(state.unsaved)
                offsets = dict(state.wal_offsets)
            seq = self.checkpoints.write(run_id, cursor, issued, offsets)
            with state.lock:
                self._saved(run_id, state, cursor, seq, len(issued))

    def close(self) -> None:
        """Graceful shutdown (requests drained): stop the thread, checkpoint every run."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)
        with self._guard:
            run_ids = list(self._states)
        for run_id in run_ids:
            try:
                self.checkpoint(run_id)
            except Exception as err:  # the log still holds what the checkpoint lacks
                log.error("final prompt-cursor checkpoint of run %s failed: %s", run_id, err)

    # -- serving -----------------------------------------------------------------------

    def _state(self, run_id: str) -> _RunState:
        with self._guard:
            return self._states.setdefault(run_id, _RunState())

    async def _submit(self, run_id: str, kind: Literal["serve", "recycle", "cursor"],
                      **fields: Any) -> dict[str, Any]:
        state = self._state(run_id)
        request = _Request(kind, asyncio.get_running_loop().create_future(), **fields)
        state.queue.append(request)
        if not state.draining:
            state.draining = True
            asyncio.get_running_loop().create_task(self._drain(run_id, state))
        return await request.future

    async def _drain(self, run_id: str, state: _RunState) -> None:
        """The run's single cursor writer: serves everything queued, in arrival order, with
        consecutive serves as one batch; runs until the queue is empty."""
        try:
            while state.queue:
                queued, state.queue = state.queue, []
                while queued:
                    n = 1
                    if queued[0].kind == "serve":
                        while n < len(queued) and queued[n].kind == "serve":
                            n += 1
                    batch, queued = queued[:n], queued[n:]
                    try:
                        if batch[0].kind == "serve":
                            await self._serve_batch(run_id, state, batch)
                        elif batch[0].kind == "recycle":
                            _answer(batch[0], await run_in_threadpool(
                                self._recycle, run_id, state, batch[0].groups,
                                batch[0].samples))
                        else:
                            _answer(batch[0], await self._cursor_answer(run_id, state))
                    except Exception as err:  # every waiter of the batch gets the failure
                        for request in batch:
                            if not request.future.done():
                                request.future.set_exception(err)
        finally:
            state.draining = False
        if len(state.unsaved) >= self.checkpoint_groups:
            self._wake.set()

    def _warm(self, state: _RunState, batch: list[_Request]) -> bool:
        """Whether preparing `batch` needs no I/O (else it runs in a worker thread)."""
        return (state.cursor is not None and state.rows is not None and not state.fenced
                and state.info is not None and state.info.loaded
                and (all(r.step is not None for r in batch)
                     or (state.steps is not None and state.steps.loaded)))

    async def _serve_batch(self, run_id: str, state: _RunState, batch: list[_Request]) -> None:
        if self._warm(state, batch):
            prepared = self._prepare(run_id, state, batch)
        else:
            prepared = await run_in_threadpool(self._prepare, run_id, state, batch)
        acks = await self.producer.send_async(prepared.records)
        # Acknowledged (acks=all): only now do the groups count as issued.
        with state.lock:
            assert state.cursor is not None
            state.cursor = replace(prepared.after, seq=state.cursor.seq)
            for ack in acks:
                if ack.offset + 1 > state.wal_offsets.get(ack.partition, 0):
                    state.wal_offsets[ack.partition] = ack.offset + 1
            state.unsaved.extend(prepared.issued)
            state.recent_rows.update(prepared.issued)
            for origin in prepared.resumed:
                state.recycled.pop(origin, None)
            described = state.cursor.describe()
        for request, out in prepared.answers:
            _answer(request, {"run_id": run_id, "groups": out, "cursor": described})

    async def _cursor_answer(self, run_id: str, state: _RunState) -> dict[str, Any]:
        if state.cursor is None or state.fenced:
            def restore() -> None:
                with state.lock:
                    if state.cursor is None and not state.fenced and \
                            self.checkpoints.last(run_id) is None:
                        raise NotFoundError(f"run {run_id!r} has not been served any prompts yet")
                    self._current(run_id, state)
            await run_in_threadpool(restore)
        assert state.cursor is not None
        return state.cursor.describe()

    def _recycle(self, run_id: str, state: _RunState, group_indices: list[int],
                 samples: list[dict[str, Any]]) -> dict[str, Any]:
        with state.checkpoint_lock, state.lock:
            cursor = self._current(run_id, state)
            known = self._issued_rows(run_id, state)
            unknown = [g for g in group_indices if g not in known]
            if unknown:
                raise NotFoundError(f"groups {unknown[:10]} of run {run_id!r} were not issued "
                                    "by this gateway, so they cannot be recycled")
            fresh = [g for g in dict.fromkeys(group_indices) if g not in cursor.recycle_groups]
            kept = [s for s in samples if s["group_index"] in fresh]
            if kept:  # before the checkpoint: a queued group always finds its samples
                self.recycled_samples.write(run_id, kept)
            after = replace(cursor,
                            recycle_rows=cursor.recycle_rows + tuple(known[g] for g in fresh),
                            recycle_groups=cursor.recycle_groups + tuple(fresh))
            self._save(run_id, state, after)
            for sample in kept:
                state.recycled.setdefault(sample["group_index"], []).append(sample)
            assert state.cursor is not None
            return {"run_id": run_id, "cursor": state.cursor.describe()}

    def _info(self, run_id: str, state: _RunState) -> RunInfo:
        if state.info is None:
            state.info = _Cached(lambda: self.runs.get(run_id), RUN_INFO_TTL_S)
        info = state.info.get()
        if info is None:
            raise NotFoundError(f"run {run_id!r} is unknown (no run_started on the runs topic)")
        if info.dataset is None:
            raise ConflictError(f"run {run_id!r} was started without a dataset to serve from")
        return info

    def _sealed_steps(self, run_id: str, state: _RunState) -> int:
        """The run's current step = how many steps are sealed (0 before the `steps` table)."""
        if state.steps is None:
            state.steps = _Cached(lambda: self.lake.read(
                "steps", filter=pc.field("run_id") == run_id, columns=["step"]).num_rows,
                STEPS_TTL_S)
        return state.steps.get()

    def _prepare(self, run_id: str, state: _RunState, batch: list[_Request]) -> _Prepared:
        """The batch's groups, events and answers from a copy of the cursor (no change yet)."""
        info = self._info(run_id, state)
        with state.lock:
            cursor = self._current(run_id, state)
        rows = state.rows
        if rows is None:
            rows = state.rows = self.datasets.rows(cursor.dataset, cursor.dataset_version)
        step_now: int | None = None
        served: list[tuple[_Request, list[Issued], int]] = []
        for request in batch:
            step = request.step
            if step is None:
                if step_now is None:
                    step_now = self._sealed_steps(run_id, state)
                step = step_now
            cursor, issued = take(cursor, rows.num_rows, request.count)
            served.append((request, issued, step))
        n_samples = info.config.n_samples_per_prompt
        ref = {"dataset": cursor.dataset, "version": cursor.dataset_version}
        answers: list[tuple[_Request, list[dict[str, Any]]]] = []
        records: list[Record] = []
        for request, issued, step in served:
            picked = rows.take(pa.array([i.row for i in issued], pa.int64())).to_pydict()
            out = []
            for k, item in enumerate(issued):
                label = picked["label"][k]
                group = {
                    "group_index": item.group_index, "step": step, "n_samples": n_samples,
                    "prompt": orjson.loads(picked["prompt"][k]),
                    "label": None if label is None else orjson.loads(label),
                    "metadata": orjson.loads(picked["metadata"][k]),
                    "prompt_ref": {**ref, "row": item.row},
                }
                event = parse_event({
                    "event_id": f"{run_id}/group_started/{item.group_index}",
                    "type": "group_started", "schema_version": 1, "run_id": run_id,
                    "producer": "gateway", **group,
                })
                records.append(event_record(event, self.producer.topics))
                out.append({**group, "epoch": item.epoch, "recycled_from": item.recycled_from,
                            "samples": state.recycled.get(item.recycled_from, [])
                            if item.recycled_from is not None else []})
            answers.append((request, out))
        issued_all = [(i.group_index, i.row) for _, issued, _ in served for i in issued]
        resumed = [i.recycled_from for _, issued, _ in served for i in issued
                   if i.recycled_from is not None]
        return _Prepared(cursor, records, answers, issued_all, resumed)

    # -- restore -------------------------------------------------------------------------

    def _current(self, run_id: str, state: _RunState) -> Cursor:
        """The run's cursor, restored on first use (caller holds `state.lock`)."""
        if state.fenced:
            _forget(state)
            raise _moved(run_id)
        if state.cursor is None:
            self._restore(run_id, state)
        assert state.cursor is not None
        return state.cursor

    def _restore(self, run_id: str, state: _RunState) -> None:
        """Last checkpoint + roll-forward over the run's `group_started` events after it."""
        saved = self.checkpoints.last(run_id)
        offsets = self.checkpoints.log_start(run_id, saved.seq) if saved is not None else {}
        logged, seen = read_group_log(self.producer.kafka, self.producer.topics.events, run_id,
                                      offsets)
        base = saved
        if base is None:
            base = self._fresh(run_id, self._info(run_id, state))
            pinned = {version for refs in logged.values() for dataset, version, _ in refs
                      if dataset == base.dataset and version is not None}
            if pinned:  # served before, crashed before the first checkpoint: keep its version
                base = replace(base, dataset_version=min(pinned))
        n_rows = self.datasets.rows(base.dataset, base.dataset_version).num_rows
        cursor, issued = roll_forward(base, n_rows, logged)
        state.cursor, state.saved, state.saved_at = cursor, saved, time.monotonic()
        state.rows = None
        state.unsaved = [(i.group_index, i.row) for i in issued]
        state.recent_rows = dict(state.unsaved)
        state.past_rows = None
        state.wal_offsets = {p: max(offsets.get(p, 0), seen.get(p, 0))
                             for p in offsets.keys() | seen.keys()}
        state.recycled = self.recycled_samples.read(run_id, cursor.recycle_groups)
        if issued:
            log.info("run %s: rolled the prompt cursor forward by %d groups from checkpoint "
                     "%s to group %d", run_id, len(issued), saved.seq if saved else None,
                     cursor.next_group_index)
        if saved is None:
            # Pin the dataset version and seed before the first group is handed out; the
            # log does not carry them. (No other writer can run: the cursor was None.)
            seq = self.checkpoints.write(run_id, cursor, list(state.unsaved),
                                         dict(state.wal_offsets))
            self._saved(run_id, state, cursor, seq, len(state.unsaved))

    def _fresh(self, run_id: str, info: RunInfo) -> Cursor:
        # The run's dataset is a free string on the wire: never let it name another folder.
        dataset = info.dataset
        table = (self.datasets.table(dataset)
                 if dataset is not None and re.match(DATASET_NAME, dataset) else None)
        if dataset is None or table is None:
            raise ConflictError(f"run {run_id!r} serves dataset {dataset!r}, which does "
                                "not exist; upload it with POST /v1/datasets/{name}")
        extra = info.config.extra_args
        return Cursor(run_id=run_id, seq=0, dataset=dataset, dataset_version=table.version(),
                      seed=int(extra.get("rollout_seed", DEFAULT_SEED)),
                      shuffle=bool(extra.get("rollout_shuffle", True)))

    def _issued_rows(self, run_id: str, state: _RunState) -> dict[int, int]:
        if state.past_rows is None:
            state.past_rows = self.checkpoints.issued_rows(run_id)
        return {**state.past_rows, **state.recent_rows}

    # -- checkpoints ---------------------------------------------------------------------

    def _save(self, run_id: str, state: _RunState, cursor: Cursor) -> None:
        """Checkpoint `cursor` synchronously and adopt it (caller holds both locks)."""
        issued = list(state.unsaved)
        seq = self.checkpoints.write(run_id, cursor, issued, dict(state.wal_offsets))
        if seq is not None:
            state.cursor = cursor
        self._saved(run_id, state, cursor, seq, len(issued))

    def _saved(self, run_id: str, state: _RunState, cursor: Cursor, seq: int | None,
               n_issued: int) -> None:
        """Record a written checkpoint (caller holds `state.lock`)."""
        if seq is None:
            state.fenced = True
            log.error("prompt cursor of run %s: checkpoint %d exists already (another "
                      "gateway serves this run?); reloading", run_id, cursor.seq + 1)
            raise _moved(run_id)
        saved = replace(cursor, seq=seq)
        written, state.unsaved = state.unsaved[:n_issued], state.unsaved[n_issued:]
        if state.past_rows is not None:
            state.past_rows.update(written)
        state.saved, state.saved_at = saved, time.monotonic()
        if state.cursor is not None:
            state.cursor = replace(state.cursor, seq=seq)

    def _checkpoint_loop(self) -> None:
        tick = min(self.checkpoint_interval_s / 4, 0.5)
        while not self._stopping:
            self._wake.wait(tick)
            self._wake.clear()
            if self._stopping:
                return
            now = time.monotonic()
            with self._guard:
                states = list(self._states.items())
            for run_id, state in states:
                due = len(state.unsaved) >= self.checkpoint_groups or (
                    state.cursor is not None and now - state.saved_at >= self.checkpoint_interval_s
                    and (state.unsaved or state.saved is None
                         or replace(state.cursor, seq=state.saved.seq) != state.saved))
                if not due:
                    continue
                try:
                    self.checkpoint(run_id)
                except Exception as err:  # retried next tick; the log covers the gap
                    log.warning("prompt-cursor checkpoint of run %s failed: %s", run_id, err)


def _answer(request: _Request, result: dict[str, Any]) -> None:
    if not request.future.done():  # a caller that went away (cancelled) loses its groups
        request.future.set_result(result)


def _forget(state: _RunState) -> None:
    state.cursor = state.saved = state.past_rows = state.rows = None
    state.unsaved, state.recent_rows, state.wal_offsets, state.recycled = [], {}, {}, {}
    state.fenced = False


def _moved(run_id: str) -> ConflictError:
    return ConflictError(f"the prompt cursor of run {run_id!r} moved concurrently "
                         "(another gateway?); retry the request")
