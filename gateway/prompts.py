"""Prompt serving: the next N prompt groups of a run's dataset, with a durable cursor.

Order (MILES_SEMANTICS 3.3/3.4): recycled groups first (FIFO), then the dataset in epoch
order, epoch e being `numpy.random.default_rng(seed + e).permutation(n)` of the original
rows (or the original order with `rollout_shuffle: false`). A request may wrap any number
of epochs. `seed` is the run config's `rollout_seed` (default 42).

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
- Restore (first use of a run in a process): load the last checkpoint, read the run's
  `group_started` events after it, and replay `take` up to the first index missing from
  the log. Groups past such a gap belong to a failed batch that nobody received; they are
  issued again. The replayed rows are checked against the rows the events name.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from kafka import TopicPartition
from kafka.errors import KafkaError
from starlette.concurrency import run_in_threadpool

from gateway.datasets import DATASET_NAME, DatasetStore
from gateway.errors import ApiError
from gateway.producer import GatewayProducer
from gateway.runs import RunInfo, RunRegistry
from ingest.io.lake import Lake, TxnMark
from schemas.errors import BrokerUnavailableError, EventValidationError
from schemas.events import GroupStarted, decode_event, encode_event, event_group_key, parse_event
from schemas.tables import PROMPT_CURSOR, PROMPT_CURSOR_WAL

log = logging.getLogger(__name__)

DEFAULT_SEED = 42
# A run's config (from the runs topic) and its number of sealed steps (the default `step`,
# from Delta) are re-read in the background once older than this; requests never wait for
# that I/O after a run's first request. A new `n_samples_per_prompt` or a newly sealed
# step therefore applies within about this long.
RUN_INFO_TTL_S = 1.0
STEPS_TTL_S = 0.25
# Roll-forward reads: poll timeout, and the quiet poll that confirms the end (Tansu
# under-reports end offsets of multi-record batches, so end_offsets alone stops early).
WAL_POLL_MS = 200
WAL_QUIET_MS = 500
WAL_READ_LIMIT_S = 300.0
_GROUP_STARTED = frozenset({"group_started"})


@dataclass(frozen=True)
class Cursor:
    """Where a run's prompt stream stands (one `prompt_cursor` row). `seq` numbers the
    checkpoints: it is the seq of the last checkpoint written, not a request counter."""

    run_id: str
    seq: int
    dataset: str
    dataset_version: int
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0
    next_group_index: int = 0
    recycle_rows: tuple[int, ...] = ()
    recycle_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Issued:
    group_index: int
    row: int
    epoch: int | None  # None for a recycled group
    recycled_from: int | None


@functools.lru_cache(maxsize=16)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row order of one epoch; depends only on (n, seed, epoch), so it survives restarts."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng(seed + epoch).permutation(n)


def take(cursor: Cursor, n_rows: int, count: int) -> tuple[Cursor, list[Issued]]:
    """The next `count` groups: recycled first, then epoch order, rolling over epochs.

    `take(take(c, a), b)` issues the same groups as `take(c, a + b)`, so the roll-forward
    may replay any number of requests as one."""
    issued: list[Issued] = []
    group = cursor.next_group_index
    recycled = min(count, len(cursor.recycle_rows))
    for row, origin in zip(cursor.recycle_rows[:recycled], cursor.recycle_groups[:recycled],
                           strict=True):
        issued.append(Issued(group, row, None, origin))
        group += 1
    epoch, offset = cursor.epoch, cursor.offset
    while len(issued) < count:
        if offset >= n_rows:
            epoch, offset = epoch + 1, 0
        order = epoch_order(n_rows, cursor.seed, epoch, cursor.shuffle)
        chunk = order[offset: offset + count - len(issued)]
        for row in chunk.tolist():
            issued.append(Issued(group, row, epoch, None))
            group += 1
        offset += len(chunk)
    after = replace(
        cursor, epoch=epoch, offset=offset, next_group_index=group,
        recycle_rows=cursor.recycle_rows[recycled:],
        recycle_groups=cursor.recycle_groups[recycled:],
    )
    return after, issued


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


@dataclass
class _Prepared:
    after: Cursor
    records: list[tuple[str, bytes, bytes]]
    answers: list[tuple[_Request, list[dict[str, Any]]]]
    issued: list[tuple[int, int]]


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

    async def recycle(self, run_id: str, group_indices: list[int]) -> dict[str, Any]:
        """Append issued groups to the recycle FIFO; durable (a checkpoint) before it returns."""
        return await self._submit(run_id, "recycle", groups=group_indices)

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
            seq = self._write(run_id, cursor, issued, offsets)
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
                                self._recycle, run_id, state, batch[0].groups))
                        else:
                            _answer(batch[0], await self._describe(run_id, state))
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
            described = _describe(state.cursor)
        for request, out in prepared.answers:
            _answer(request, {"run_id": run_id, "groups": out, "cursor": described})

    async def _describe(self, run_id: str, state: _RunState) -> dict[str, Any]:
        if state.cursor is None or state.fenced:
            def restore() -> None:
                with state.lock:
                    if state.cursor is None and not state.fenced and self._load(run_id) is None:
                        raise ApiError(404, f"run {run_id!r} has not been served any prompts yet")
                    self._current(run_id, state)
            await run_in_threadpool(restore)
        assert state.cursor is not None
        return _describe(state.cursor)

    def _recycle(self, run_id: str, state: _RunState, group_indices: list[int]) -> dict[str, Any]:
        with state.checkpoint_lock, state.lock:
            cursor = self._current(run_id, state)
            known = self._issued_rows(run_id, state)
            unknown = [g for g in group_indices if g not in known]
            if unknown:
                raise ApiError(404, f"groups {unknown[:10]} of run {run_id!r} were not issued by "
                                    "this gateway, so they cannot be recycled")
            fresh = [g for g in dict.fromkeys(group_indices) if g not in cursor.recycle_groups]
            after = replace(cursor,
                            recycle_rows=cursor.recycle_rows + tuple(known[g] for g in fresh),
                            recycle_groups=cursor.recycle_groups + tuple(fresh))
            self._save(run_id, state, after)
            assert state.cursor is not None
            return {"run_id": run_id, "cursor": _describe(state.cursor)}

    def _info(self, run_id: str, state: _RunState) -> RunInfo:
        if state.info is None:
            state.info = _Cached(lambda: self.runs.get(run_id), RUN_INFO_TTL_S)
        info = state.info.get()
        if info is None:
            raise ApiError(404, f"run {run_id!r} is unknown (no run_started on the runs topic)")
        if info.dataset is None:
            raise ApiError(409, f"run {run_id!r} was started without a dataset to serve from")
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
            if request.step is None and step_now is None:
                step_now = self._sealed_steps(run_id, state)
            cursor, issued = take(cursor, rows.num_rows, request.count)
            served.append((request, issued, request.step if request.step is not None else step_now))
        n_samples = info.config.n_samples_per_prompt
        ref = {"dataset": cursor.dataset, "version": cursor.dataset_version}
        answers: list[tuple[_Request, list[dict[str, Any]]]] = []
        records = []
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
                records.append((self.producer.topics.events,
                                event_group_key(run_id, item.group_index), encode_event(event)))
                out.append({**group, "epoch": item.epoch, "recycled_from": item.recycled_from})
            answers.append((request, out))
        issued_all = [(i.group_index, i.row) for _, issued, _ in served for i in issued]
        return _Prepared(cursor, records, answers, issued_all)

    # -- restore -------------------------------------------------------------------------

    def _current(self, run_id: str, state: _RunState) -> Cursor:
        """The run's cursor, restored on first use (caller holds `state.lock`)."""
        if state.fenced:
            _forget(state)
            raise ApiError(409, f"the prompt cursor of run {run_id!r} moved concurrently "
                                "(another gateway?); retry the request")
        if state.cursor is None:
            self._restore(run_id, state)
        assert state.cursor is not None
        return state.cursor

    def _restore(self, run_id: str, state: _RunState) -> None:
        """Last checkpoint + roll-forward over the run's `group_started` events after it."""
        saved = self._load(run_id)
        offsets = self._load_wal_offsets(run_id, saved.seq) if saved is not None else {}
        logged, seen = self._read_log(run_id, offsets)
        base = saved
        if base is None:
            base = self._fresh(run_id, self._info(run_id, state))
            pinned = {r[1] for refs in logged.values() for r in refs if r[0] == base.dataset}
            if pinned:  # served before, crashed before the first checkpoint: keep its version
                base = replace(base, dataset_version=min(pinned))
        end = base.next_group_index
        while end in logged:
            end += 1
        n_rows = self.datasets.rows(base.dataset, base.dataset_version).num_rows
        cursor, issued = take(base, n_rows, end - base.next_group_index)
        for item in issued:
            if (base.dataset, base.dataset_version, item.row) not in logged[item.group_index]:
                raise ApiError(500, f"cannot restore the prompt cursor of run {run_id!r}: group "
                                    f"{item.group_index} was published with prompt "
                                    f"{sorted(logged[item.group_index])}, the replay gives row "
                                    f"{item.row}")
        state.cursor, state.saved, state.saved_at = cursor, saved, time.monotonic()
        state.rows = None
        state.unsaved = [(i.group_index, i.row) for i in issued]
        state.recent_rows = dict(state.unsaved)
        state.past_rows = None
        state.wal_offsets = {p: max(offsets.get(p, 0), seen.get(p, 0))
                             for p in offsets.keys() | seen.keys()}
        if issued:
            log.info("run %s: rolled the prompt cursor forward by %d groups from checkpoint "
                     "%s to group %d", run_id, len(issued), saved.seq if saved else None, end)
        if saved is None:
            # Pin the dataset version and seed before the first group is handed out; the
            # log does not carry them. (No other writer can run: the cursor was None.)
            seq = self._write(run_id, cursor, list(state.unsaved), dict(state.wal_offsets))
            self._saved(run_id, state, cursor, seq, len(state.unsaved))

    def _fresh(self, run_id: str, info: RunInfo) -> Cursor:
        # The run's dataset is a free string on the wire: never let it name another folder.
        valid = info.dataset is not None and re.match(DATASET_NAME, info.dataset)
        table = self.datasets.table(info.dataset) if valid else None
        if table is None:
            raise ApiError(409, f"run {run_id!r} serves dataset {info.dataset!r}, which does "
                                "not exist; upload it with POST /v1/datasets/{name}")
        extra = info.config.extra_args
        assert info.dataset is not None
        return Cursor(run_id=run_id, seq=0, dataset=info.dataset, dataset_version=table.version(),
                      seed=int(extra.get("rollout_seed", DEFAULT_SEED)),
                      shuffle=bool(extra.get("rollout_shuffle", True)))

    def _rows(self, run_id: str) -> pa.Table:
        return self.lake.read(PROMPT_CURSOR.name, filter=pc.field("run_id") == run_id)

    def _load(self, run_id: str) -> Cursor | None:
        table = self._rows(run_id)
        if table.num_rows == 0:
            return None
        last = table.take([pc.index(table["seq"], pc.max(table["seq"])).as_py()]).to_pylist()[0]
        return Cursor(
            run_id=run_id, seq=last["seq"], dataset=last["dataset"],
            dataset_version=last["dataset_version"], seed=last["seed"], shuffle=last["shuffle"],
            epoch=last["epoch"], offset=last["offset"], next_group_index=last["next_group_index"],
            recycle_rows=tuple(last["recycle_rows"]), recycle_groups=tuple(last["recycle_groups"]),
        )

    def _load_wal_offsets(self, run_id: str, seq: int) -> dict[int, int]:
        """Where the log of checkpoint `seq` starts, per partition ({} = from the beginning)."""
        if not self.lake.exists(PROMPT_CURSOR_WAL.name):
            return {}
        table = self.lake.read(PROMPT_CURSOR_WAL.name, filter=(pc.field("run_id") == run_id)
                               & (pc.field("seq") == seq))
        topic = self.producer.topics.events
        for row in table.to_pylist()[-1:]:
            if row["topic"] == topic:
                return dict(zip(row["partitions"], row["offsets"], strict=True))
        return {}

    def _read_log(self, run_id: str, start: dict[int, int]
                  ) -> tuple[dict[int, set[tuple[str, int | None, int]]], dict[int, int]]:
        """The run's `group_started` events from `start` to the end of the events topic:
        group -> {(dataset, version, row)}, and per partition the offset after the last."""
        topic = self.producer.topics.events
        prefix = f"{run_id}:".encode()
        logged: dict[int, set[tuple[str, int | None, int]]] = {}
        seen: dict[int, int] = {}
        consumer = self.producer.kafka.consumer()
        try:
            parts = [TopicPartition(topic, p)
                     for p in sorted(consumer.partitions_for_topic(topic) or {0})]
            consumer.assign(parts)
            first = consumer.beginning_offsets(parts)
            for tp in parts:
                at = start.get(tp.partition, 0)
                if first[tp] > at:
                    raise ApiError(503, f"cannot restore the prompt cursor of run {run_id!r}: "
                                        f"{topic} partition {tp.partition} no longer holds "
                                        f"offset {at} (retention?)")
                consumer.seek(tp, at)
            end = consumer.end_offsets(parts)
            deadline = time.monotonic() + WAL_READ_LIMIT_S
            while time.monotonic() < deadline:
                polled = consumer.poll(WAL_POLL_MS)
                if not polled:
                    if any(consumer.position(tp) < end[tp] for tp in parts):
                        continue
                    polled = consumer.poll(WAL_QUIET_MS)  # past the reported end: until quiet
                    if not polled:
                        break
                for tp, records in polled.items():
                    for record in records:
                        if not (record.key or b"").startswith(prefix) or \
                                b"group_started" not in record.value:
                            continue
                        try:
                            event = decode_event(record.value, allowed=_GROUP_STARTED)
                        except EventValidationError:
                            continue
                        assert isinstance(event, GroupStarted)
                        if event.run_id != run_id or event.prompt_ref is None:
                            continue
                        ref = event.prompt_ref
                        logged.setdefault(event.group_index, set()).add(
                            (ref.dataset, getattr(ref, "version", None), ref.row))
                        seen[tp.partition] = max(seen.get(tp.partition, 0), record.offset + 1)
            else:
                raise ApiError(503, f"reading {topic} to restore run {run_id!r} took over "
                                    f"{WAL_READ_LIMIT_S:.0f} s")
        except KafkaError as err:
            raise BrokerUnavailableError(
                f"could not read {topic} to restore the prompt cursor: {type(err).__name__}"
            ) from None
        finally:
            consumer.close()
        return logged, seen

    def _issued_rows(self, run_id: str, state: _RunState) -> dict[int, int]:
        if state.past_rows is None:
            table = self._rows(run_id)
            state.past_rows = dict(zip(pc.list_flatten(table["issued_groups"]).to_pylist(),
                                       pc.list_flatten(table["issued_rows"]).to_pylist(),
                                       strict=True))
        return {**state.past_rows, **state.recent_rows}

    # -- checkpoints ---------------------------------------------------------------------

    def _save(self, run_id: str, state: _RunState, cursor: Cursor) -> None:
        """Checkpoint `cursor` synchronously and adopt it (caller holds both locks)."""
        issued = list(state.unsaved)
        seq = self._write(run_id, cursor, issued, dict(state.wal_offsets))
        if seq is not None:
            state.cursor = cursor
        self._saved(run_id, state, cursor, seq, len(issued))

    def _write(self, run_id: str, cursor: Cursor, issued: list[tuple[int, int]],
               offsets: dict[int, int]) -> int | None:
        """Append checkpoint seq+1 (its log offsets first); None if that seq already exists."""
        seq = cursor.seq + 1
        now = datetime.now(UTC)
        parts = sorted(offsets)
        self.lake.append(PROMPT_CURSOR_WAL.name, pa.Table.from_pylist([{
            "run_id": run_id, "seq": seq, "topic": self.producer.topics.events,
            "partitions": parts, "offsets": [offsets[p] for p in parts], "committed_at": now,
        }], schema=PROMPT_CURSOR_WAL.schema))
        row = {**replace(cursor, seq=seq).__dict__, "recycle_rows": list(cursor.recycle_rows),
               "recycle_groups": list(cursor.recycle_groups),
               "issued_groups": [g for g, _ in issued], "issued_rows": [r for _, r in issued],
               "committed_at": now}
        table = pa.Table.from_pylist([row], schema=PROMPT_CURSOR.schema)
        version = self.lake.append(PROMPT_CURSOR.name, table,
                                   marks=[TxnMark(f"prompt-cursor-{run_id}", seq)])
        return None if version is None else seq

    def _saved(self, run_id: str, state: _RunState, cursor: Cursor, seq: int | None,
               n_issued: int) -> None:
        """Record a written checkpoint (caller holds `state.lock`)."""
        if seq is None:
            state.fenced = True
            log.error("prompt cursor of run %s: checkpoint %d exists already (another "
                      "gateway serves this run?); reloading", run_id, cursor.seq + 1)
            raise ApiError(409, f"the prompt cursor of run {run_id!r} moved concurrently "
                                "(another gateway?); retry the request")
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
    state.unsaved, state.recent_rows, state.wal_offsets = [], {}, {}
    state.fenced = False


def _describe(cursor: Cursor) -> dict[str, Any]:
    return {
        "dataset": cursor.dataset, "dataset_version": cursor.dataset_version,
        "seed": cursor.seed, "shuffle": cursor.shuffle, "epoch": cursor.epoch,
        "offset": cursor.offset, "next_group_index": cursor.next_group_index,
        "recycle_groups": list(cursor.recycle_groups), "seq": cursor.seq,
    }
