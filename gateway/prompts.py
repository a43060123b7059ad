"""Prompt serving: the next N prompt groups of a run's dataset, with a durable cursor.

Order (MILES_SEMANTICS 3.3/3.4): recycled groups first (FIFO), then the dataset in epoch
order, epoch e being `numpy.random.default_rng(seed + e).permutation(n)` of the original
rows (or the original order with `rollout_shuffle: false`). A request may wrap any number
of epochs. `seed` is the run config's `rollout_seed` (default 42).

Durability and concurrency: requests for one run queue up and are handled in batches by
whichever request holds the run's commit lock (group commit). A batch publishes its
`group_started` events, waits for the acks, then appends one cursor row to Delta; only
then are the groups handed out. A crash in between leaves the cursor where it was, and the
retry issues the same group indices with the same deterministic `event_id`s, which the
processor applies once. So a group is never given to two callers and none is skipped.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from gateway.datasets import DATASET_NAME, DatasetStore
from gateway.errors import ApiError
from gateway.producer import GatewayProducer
from gateway.runs import RunInfo, RunRegistry
from ingest.lake import Lake, TxnMark
from schemas.events import encode_event, event_group_key, parse_event
from schemas.tables import PROMPT_CURSOR

DEFAULT_SEED = 42
# A run's config is re-read from the runs topic at most this often while it is being served
# (one Kafka round trip per read): a new `n_samples_per_prompt` applies within a second.
RUN_INFO_TTL_S = 1.0


@dataclass(frozen=True)
class Cursor:
    """Where a run's prompt stream stands (one `prompt_cursor` row)."""

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
    """The next `count` groups: recycled first, then epoch order, rolling over epochs."""
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
        cursor, seq=cursor.seq + 1, epoch=epoch, offset=offset, next_group_index=group,
        recycle_rows=cursor.recycle_rows[recycled:],
        recycle_groups=cursor.recycle_groups[recycled:],
    )
    return after, issued


@dataclass
class _Request:
    """One caller waiting in a run's queue: a serve (count) or a recycle (groups)."""

    count: int = 0
    step: int | None = None
    recycle: list[int] | None = None
    done: bool = False
    result: Any = None
    error: Exception | None = None


@dataclass
class _RunState:
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    queue_lock: threading.Lock = field(default_factory=threading.Lock)
    queue: list[_Request] = field(default_factory=list)
    cursor: Cursor | None = None
    issued_rows: dict[int, int] | None = None  # group_index -> dataset row, loaded for recycle


class PromptService:
    """Serves prompt groups for every run; one `_RunState` per run."""

    def __init__(self, lake: Lake, datasets: DatasetStore, runs: RunRegistry,
                 producer: GatewayProducer):
        self.lake = lake
        self.datasets = datasets
        self.runs = runs
        self.producer = producer
        self._states: dict[str, _RunState] = {}
        self._guard = threading.Lock()
        self._run_info: dict[str, tuple[float, RunInfo]] = {}

    def serve(self, run_id: str, count: int, step: int | None) -> dict[str, Any]:
        return self._submit(run_id, _Request(count=count, step=step))

    def recycle(self, run_id: str, group_indices: list[int]) -> dict[str, Any]:
        return self._submit(run_id, _Request(recycle=group_indices))

    def cursor(self, run_id: str) -> dict[str, Any]:
        state = self._state(run_id)
        with state.commit_lock:
            cursor = state.cursor or self._load(run_id)
        if cursor is None:
            raise ApiError(404, f"run {run_id!r} has not been served any prompts yet")
        return _describe(cursor)

    # -- batching ----------------------------------------------------------------------

    def _state(self, run_id: str) -> _RunState:
        with self._guard:
            return self._states.setdefault(run_id, _RunState())

    def _submit(self, run_id: str, request: _Request) -> dict[str, Any]:
        state = self._state(run_id)
        with state.queue_lock:
            state.queue.append(request)
        with state.commit_lock:
            if not request.done:  # nobody took it yet: lead a batch of everything queued
                with state.queue_lock:
                    batch, state.queue = state.queue, []
                try:
                    self._process(run_id, state, batch)
                except Exception as err:  # every waiter of the batch must get the failure
                    for waiting in batch:
                        if not waiting.done:
                            waiting.error, waiting.done = err, True
        if request.error is not None:
            raise request.error
        return request.result

    def _info(self, run_id: str) -> RunInfo | None:
        cached = self._run_info.get(run_id)
        if cached is not None and time.monotonic() - cached[0] < RUN_INFO_TTL_S:
            return cached[1]
        info = self.runs.get(run_id)
        if info is not None:
            self._run_info[run_id] = (time.monotonic(), info)
        return info

    def _process(self, run_id: str, state: _RunState, batch: list[_Request]) -> None:
        info = self._info(run_id)
        if info is None:
            raise ApiError(404, f"run {run_id!r} is unknown (no run_started on the runs topic)")
        if info.dataset is None:
            raise ApiError(409, f"run {run_id!r} was started without a dataset to serve from")
        cursor = state.cursor or self._load(run_id) or self._fresh(run_id, info)
        rows = self.datasets.rows(cursor.dataset, cursor.dataset_version)
        step_now: int | None = None
        served: list[tuple[_Request, list[Issued], int]] = []
        recycled: list[_Request] = []
        start = cursor
        for request in batch:
            if request.recycle is not None:
                try:
                    cursor = self._add_recycled(run_id, state, cursor, request.recycle)
                except ApiError as err:
                    request.error, request.done = err, True
                    continue
                recycled.append(request)
                continue
            if request.step is None and step_now is None:
                step_now = self._sealed_steps(run_id)
            cursor, issued = take(cursor, rows.num_rows, request.count)
            served.append((request, issued, request.step if request.step is not None else step_now))
        if cursor == start:
            return
        n_samples = info.config.n_samples_per_prompt
        groups: list[tuple[_Request, list[dict[str, Any]]]] = []
        records = []
        for request, issued, step in served:
            picked = rows.take(pa.array([i.row for i in issued], pa.int64())).to_pydict()
            out = []
            for k, item in enumerate(issued):
                group = {
                    "group_index": item.group_index,
                    "step": step,
                    "n_samples": n_samples,
                    "prompt": orjson.loads(picked["prompt"][k]),
                    "label": None if picked["label"][k] is None else orjson.loads(picked["label"][k]),
                    "metadata": orjson.loads(picked["metadata"][k]),
                    "prompt_ref": {"dataset": cursor.dataset, "row": item.row,
                                   "version": cursor.dataset_version},
                }
                event = parse_event({
                    "event_id": f"{run_id}/group_started/{item.group_index}",
                    "type": "group_started", "schema_version": 1, "run_id": run_id,
                    "producer": "gateway", **group,
                })
                records.append((self.producer.topics.events,
                                event_group_key(run_id, item.group_index), encode_event(event)))
                out.append({**group, "epoch": item.epoch, "recycled_from": item.recycled_from})
            groups.append((request, out))
        self.producer.send(records)
        self._commit(run_id, state, cursor, [i for _, issued, _ in served for i in issued])
        for request, out in groups:
            request.result, request.done = {"run_id": run_id, "groups": out,
                                            "cursor": _describe(cursor)}, True
        for request in recycled:
            request.result, request.done = {"run_id": run_id, "cursor": _describe(cursor)}, True

    # -- cursor persistence --------------------------------------------------------------

    def _fresh(self, run_id: str, info: RunInfo) -> Cursor:
        # The run's dataset is a free string on the wire: never let it name another folder.
        valid = info.dataset is not None and re.match(DATASET_NAME, info.dataset)
        table = self.datasets.table(info.dataset) if valid else None
        if table is None:
            raise ApiError(409, f"run {run_id!r} serves dataset {info.dataset!r}, which does "
                                "not exist; upload it with POST /v1/datasets/{name}")
        extra = info.config.extra_args
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

    def _add_recycled(self, run_id: str, state: _RunState, cursor: Cursor,
                      group_indices: list[int]) -> Cursor:
        if state.issued_rows is None:
            table = self._rows(run_id)
            state.issued_rows = dict(zip(pc.list_flatten(table["issued_groups"]).to_pylist(),
                                         pc.list_flatten(table["issued_rows"]).to_pylist(),
                                         strict=True))
        unknown = [g for g in group_indices if g not in state.issued_rows]
        if unknown:
            raise ApiError(404, f"groups {unknown[:10]} of run {run_id!r} were not issued by "
                                "this gateway, so they cannot be recycled")
        fresh = [g for g in dict.fromkeys(group_indices) if g not in cursor.recycle_groups]
        return replace(cursor, seq=cursor.seq + 1,
                       recycle_rows=cursor.recycle_rows + tuple(state.issued_rows[g] for g in fresh),
                       recycle_groups=cursor.recycle_groups + tuple(fresh))

    def _commit(self, run_id: str, state: _RunState, cursor: Cursor, issued: list[Issued]) -> None:
        row = {**cursor.__dict__, "recycle_rows": list(cursor.recycle_rows),
               "recycle_groups": list(cursor.recycle_groups),
               "issued_groups": [i.group_index for i in issued],
               "issued_rows": [i.row for i in issued], "committed_at": datetime.now(UTC)}
        table = pa.Table.from_pylist([row], schema=PROMPT_CURSOR.schema)
        version = self.lake.append(PROMPT_CURSOR.name, table,
                                   marks=[TxnMark(f"prompt-cursor-{run_id}", cursor.seq)])
        if version is None:
            # Another gateway advanced this run's cursor: forget ours and make the caller retry.
            state.cursor = state.issued_rows = None
            raise ApiError(409, f"the prompt cursor of run {run_id!r} moved concurrently "
                                "(another gateway?); retry the request")
        state.cursor = cursor
        if state.issued_rows is not None:
            state.issued_rows.update((i.group_index, i.row) for i in issued)

    def _sealed_steps(self, run_id: str) -> int:
        """The run's current step = how many steps are sealed (0 before the `steps` table)."""
        return self.lake.read("steps", filter=pc.field("run_id") == run_id,
                              columns=["step"]).num_rows


def _describe(cursor: Cursor) -> dict[str, Any]:
    return {
        "dataset": cursor.dataset, "dataset_version": cursor.dataset_version,
        "seed": cursor.seed, "shuffle": cursor.shuffle, "epoch": cursor.epoch,
        "offset": cursor.offset, "next_group_index": cursor.next_group_index,
        "recycle_groups": list(cursor.recycle_groups), "seq": cursor.seq,
    }
