"""Sealed steps from Delta to torch: follow `steps`, read the pinned batch, verify, tensorise.

The trainer trusts nothing it did not verify: a step's `training_batches` rows are read at
the `batch_version` its `steps` row recorded, and must hash to its `content_sha256`
(`schemas.tables.content_sha256` over the rows in position order) before they become
tensors. Tensorisation is vectorised over Arrow buffers; there is no Python loop per row
or token, so a 4M-token step converts in well under a second.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ingest.io.lake import Lake
from schemas.errors import BatchVerificationError
from schemas.tables import STEPS, TRAINING_BATCHES, content_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRow:
    """The `steps` row of one sealed step: where its batch is and what it must hash to."""

    run_id: str
    step: int
    batch_version: int
    content_sha256: str
    n_samples: int

    @classmethod
    def from_row(cls, row: dict) -> StepRow:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


class StepFollower:
    """Polls a run's `steps` table for sealed steps."""

    def __init__(self, lake: Lake, run_id: str, *, poll_interval_s: float):
        self.lake = lake
        self.run_id = run_id
        self.poll_interval_s = poll_interval_s

    def sealed(self, step: int) -> StepRow | None:
        rows = read_run_step(self.lake, STEPS.name, self.run_id, step).to_pylist()
        if len(rows) > 1:
            raise BatchVerificationError(
                f"run {self.run_id} step {step}: the steps table holds {len(rows)} rows, expected 1"
            )
        return StepRow.from_row(rows[0]) if rows else None

    def wait_for(
        self,
        step: int | None,
        *,
        idle_timeout_s: float | None,
        stop: threading.Event | None = None,
    ) -> StepRow | None:
        """Block until `step` (or, when None, the lowest step of the run) is sealed.

        Returns None once `idle_timeout_s` passed without it, or once `stop` is set.
        """
        deadline = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
        waiting_logged = False
        while True:
            if step is None:
                where = pc.field("run_id") == self.run_id
                steps = self.lake.read(STEPS.name, filter=where, columns=["step"]).column("step")
                found = self.sealed(pc.min(steps).as_py()) if len(steps) else None
            else:
                found = self.sealed(step)
            if found is not None:
                return found
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if not waiting_logged:
                log.info("waiting for run %s step %s to be sealed", self.run_id, step)
                waiting_logged = True
            if stop is None:
                time.sleep(self.poll_interval_s)
            elif stop.wait(self.poll_interval_s):
                return None


def read_run_step(
    lake: Lake, table: str, run_id: str, step: int, version: int | None = None
) -> pa.Table:
    """One (run_id, step) of a table, its files pruned by their Delta statistics first.

    (run_id is restricted to [A-Za-z0-9._-], so it cannot break out of the SQL literal.)
    """
    rows = lake.read(table, version=version,
                     prune=f"run_id = '{run_id}' AND step = {int(step)}")
    # The surviving files usually hold only this step; filtering anyway would copy every
    # list column (pyarrow does not infer `step == s` from the files' min/max bounds).
    match = pc.and_(pc.equal(rows.column("run_id"), run_id), pc.equal(rows.column("step"), step))
    return rows if pc.all(match).as_py() else rows.filter(match)


def read_sealed_rows(lake: Lake, sealed: StepRow) -> pa.Table:
    """The step's `training_batches` rows at its recorded version, in position order, with
    row count and positions checked; `load_step` adds the content hash."""
    try:
        rows = read_run_step(
            lake, TRAINING_BATCHES.name, sealed.run_id, sealed.step, version=sealed.batch_version
        )
    except FileNotFoundError as exc:
        # The log names a data file that is gone (deleted, vacuumed, a partial copy): the
        # recorded batch cannot be read, which is a verification failure, not a crash.
        raise BatchVerificationError(
            f"{_where(sealed)}: a data file of the recorded batch is missing ({exc})"
        ) from None
    positions = rows.column("position").to_numpy()
    # Files come back in commit order, usually already sorted; sorting copies every list
    # column, so it only happens when needed.
    if np.any(positions[1:] <= positions[:-1]):
        rows = rows.sort_by("position")
        positions = rows.column("position").to_numpy()
    if rows.num_rows != sealed.n_samples:
        raise BatchVerificationError(
            f"{_where(sealed)}: read {rows.num_rows} rows, the steps table recorded "
            f"{sealed.n_samples}"
        )
    if not np.array_equal(positions, np.arange(rows.num_rows)):
        raise BatchVerificationError(f"{_where(sealed)}: positions are not 0..{rows.num_rows - 1}")
    return rows


def _where(sealed: StepRow) -> str:
    return (
        f"run {sealed.run_id} step {sealed.step} (training_batches version {sealed.batch_version})"
    )


@dataclass(frozen=True)
class StepBatch:
    """One step as right-padded tensors.

    `tokens` is [B, L] (prompt then response, int32 to halve the copy; the engine widens
    each micro-batch to int64). Per-token training
    tensors are [B, L-1], aligned with the logits that predict `tokens[:, 1:]`, so index t
    scores token t+1. `response_mask` marks trainable response positions, `loss_mask` the
    ones the loss counts. `rollout_index` numbers the step's rollouts (group_index,
    rollout_id) 0..n_rollouts-1; `rollout_mask_sums` is D_i, the loss-mask sum over every
    row of row i's rollout, so compaction siblings share one denominator.
    """

    step: int
    tokens: torch.Tensor  # [B, L] int32
    response_mask: torch.Tensor  # [B, L-1] bool
    loss_mask: torch.Tensor  # [B, L-1] float32
    advantages: torch.Tensor  # [B, L-1] float32, the row's advantage on every position
    old_log_probs: torch.Tensor  # [B, L-1] float32, 0 where absent
    has_old_log_probs: torch.Tensor  # [B] bool
    total_lengths: torch.Tensor  # [B] int64
    response_lengths: torch.Tensor  # [B] int64, trainable response positions per row
    rollout_index: torch.Tensor  # [B] int64
    rollout_mask_sums: torch.Tensor  # [B] float32
    n_rollouts: int

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, L] int64: 1 on the prompt and response, 0 on the right padding."""
        positions = torch.arange(self.tokens.shape[1])
        return (positions[None, :] < self.total_lengths[:, None]).long()

    def rows(self, part: slice) -> StepBatch:
        """Rows `part`, with the padding trimmed to their longest sequence."""
        length = int(self.total_lengths[part].max())
        return StepBatch(
            step=self.step,
            tokens=self.tokens[part, :length],
            response_mask=self.response_mask[part, : length - 1],
            loss_mask=self.loss_mask[part, : length - 1],
            advantages=self.advantages[part, : length - 1],
            old_log_probs=self.old_log_probs[part, : length - 1],
            has_old_log_probs=self.has_old_log_probs[part],
            total_lengths=self.total_lengths[part],
            response_lengths=self.response_lengths[part],
            rollout_index=self.rollout_index[part],
            rollout_mask_sums=self.rollout_mask_sums[part],
            n_rollouts=self.n_rollouts,
        )


def _list_column(rows: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, flattened values, validity) of a list column; null lists have length 0."""
    column = rows.column(name)
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy().astype(np.int64)
    values = pc.list_flatten(column).to_numpy()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return lengths, values, valid


def tensorize(rows: pa.Table, step: int) -> StepBatch:
    """Turn verified `training_batches` rows (position order) into a `StepBatch`."""
    n = rows.num_rows
    if n == 0:
        raise BatchVerificationError(f"step {step}: the sealed batch has no rows")
    prompt_len, prompt_vals, _ = _list_column(rows, "prompt_tokens")
    resp_len, resp_vals, _ = _list_column(rows, "response_tokens")
    mask_len, mask_vals, _ = _list_column(rows, "loss_mask")
    lp_len, lp_vals, has_lp = _list_column(rows, "rollout_log_probs")
    bad = np.flatnonzero((mask_len != resp_len) | (has_lp & (lp_len != resp_len)))
    if bad.size:
        raise BatchVerificationError(
            f"step {step} position {int(bad[0])}: loss_mask / rollout_log_probs length "
            "differs from response_tokens"
        )

    total_len = prompt_len + resp_len
    width = int(total_len.max())
    shape = (n, width - 1)

    # Row i's response token j sits at position prompt_len_i + j and is scored by the
    # logits one position earlier, so its values fill columns [prompt_len_i - 1,
    # prompt_len_i - 1 + resp_len_i) of the [n, width-1] grid. A response token at position
    # 0 (empty prompt) has no logits scoring it and is not trained. Rows are contiguous
    # runs in both the grid and the flattened Arrow values, so boolean-mask assignment
    # places every value in one sequential pass (several times faster than scattering
    # with an index array).
    columns = np.arange(width - 1)[None, :]
    response_mask = (columns >= np.maximum(prompt_len - 1, 0)[:, None]) & (
        columns < (prompt_len - 1 + resp_len)[:, None]
    )
    empty_prompt = np.flatnonzero((prompt_len == 0) & (resp_len > 0))
    untrained = (np.cumsum(resp_len) - resp_len)[empty_prompt]  # their first response value
    keep: slice | np.ndarray = slice(None)  # a view, not a copy, in the usual case
    if empty_prompt.size:
        keep = np.ones(resp_vals.size, dtype=bool)
        keep[untrained] = False

    tokens = np.zeros((n, width), dtype=np.int32)
    tokens[np.arange(width)[None, :] < prompt_len[:, None]] = prompt_vals
    tokens[:, 1:][response_mask] = resp_vals[keep]
    tokens[empty_prompt, 0] = resp_vals[untrained]
    loss_mask = np.zeros(shape, dtype=np.float32)
    loss_mask[response_mask] = mask_vals[keep]
    # Null lists contribute no values: spread lp_vals over the rows that have them.
    if has_lp.all():
        lp_full = lp_vals
    else:
        lp_full = np.zeros(resp_vals.size, dtype=np.float32)
        lp_full[np.repeat(has_lp, resp_len)] = lp_vals
    old_log_probs = np.zeros(shape, dtype=np.float32)
    old_log_probs[response_mask] = lp_full[keep]

    row_mask_sums = loss_mask.sum(1, dtype=np.float64)
    keys = np.stack(
        [rows.column("group_index").to_numpy(), rows.column("rollout_id").to_numpy()], axis=1
    )
    uniq, rollout_index = np.unique(keys, axis=0, return_inverse=True)
    rollout_index = rollout_index.reshape(-1)
    rollout_sums = np.bincount(rollout_index, weights=row_mask_sums)[rollout_index]
    response_lengths = resp_len.copy()
    response_lengths[empty_prompt] -= 1

    advantages = torch.from_numpy(rows.column("advantage").to_numpy().astype(np.float32))
    return StepBatch(
        step=step,
        tokens=torch.from_numpy(tokens),
        response_mask=torch.from_numpy(response_mask),
        loss_mask=torch.from_numpy(loss_mask),
        advantages=advantages[:, None].expand(shape),
        old_log_probs=torch.from_numpy(old_log_probs),
        has_old_log_probs=torch.from_numpy(has_lp.copy()),
        total_lengths=torch.from_numpy(total_len),
        response_lengths=torch.from_numpy(response_lengths),
        rollout_index=torch.from_numpy(rollout_index.astype(np.int64)),
        rollout_mask_sums=torch.from_numpy(rollout_sums.astype(np.float32)),
        n_rollouts=len(uniq),
    )


def load_step(lake: Lake, sealed: StepRow) -> StepBatch:
    """Read, verify and tensorise a sealed step; the tensors are returned only if the rows
    hash to the recorded `content_sha256`.

    Hashing runs in a thread while the rows are tensorised (hashlib and the numpy
    kernels release the GIL), which hides most of its cost.
    """
    rows = read_sealed_rows(lake, sealed)
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(content_sha256, rows)
        batch = tensorize(rows, sealed.step)
        if digest.result() != sealed.content_sha256:
            raise BatchVerificationError(
                f"{_where(sealed)}: content_sha256 of the rows is {digest.result()}, the steps "
                f"table recorded {sealed.content_sha256}; the batch was changed after sealing"
            )
    return batch


class StepPrefetcher:
    """Sealed steps in order, each read, verified and tensorised in a background thread
    while the caller trains on the previous one.

    Only one step is loaded ahead: the thread starts on step s+1 once `next` handed out
    step s, so host memory holds at most two steps' tensors. A failure of the background read (a verification error above all) is raised by the
    `next` call that asks for that step, i.e. after the steps before it were trained, as
    without prefetching. Use as a context manager: leaving it stops the thread.
    """

    def __init__(
        self,
        follower: StepFollower,
        first_step: int | None,
        *,
        load: Callable[[Lake, StepRow], StepBatch] = load_step,
    ):
        self.follower = follower
        self.load = load
        self._ready: queue.Queue[tuple[StepRow, StepBatch] | Exception] = queue.Queue(maxsize=1)
        self._room = threading.Semaphore(1)  # taken by the step being loaded ahead
        self._stop = threading.Event()
        # Steps found sealed by the thread and steps handed out: while a found step is
        # still loading, `next` waits for it even past the idle timeout, which only
        # counts time in which no step was sealed.
        self._found = 0
        self._handed = 0
        self._thread = threading.Thread(
            target=self._prefetch, args=(first_step,), name="step-prefetch", daemon=True
        )

    def __enter__(self) -> StepPrefetcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def next(self, *, idle_timeout_s: float | None) -> tuple[StepRow, StepBatch] | None:
        """The next sealed step and its tensors; None once `idle_timeout_s` passed without
        a step being sealed."""
        try:
            item = self._ready.get(timeout=idle_timeout_s)
        except queue.Empty:
            if self._found == self._handed:
                return None
            item = self._ready.get()
        self._handed += 1
        self._room.release()
        if isinstance(item, Exception):
            raise item
        return item

    def _prefetch(self, step: int | None) -> None:
        while self._wait_for_room():
            sealed = None
            item: tuple[StepRow, StepBatch] | Exception
            try:
                sealed = self.follower.wait_for(step, idle_timeout_s=None, stop=self._stop)
                if sealed is None:
                    return
                self._found += 1
                item = (sealed, self.load(self.follower.lake, sealed))
                step = sealed.step + 1
            except Exception as exc:  # raised in the training loop by `next`
                if sealed is None:
                    self._found += 1
                item = exc
            self._ready.put(item)  # never blocks: the room was taken first
            if isinstance(item, Exception):
                return

    def _wait_for_room(self) -> bool:
        """Block until the previous step was handed out; False if stopped first."""
        while not self._stop.is_set():
            if self._room.acquire(timeout=self.follower.poll_interval_s):
                return True
        return False


def plan_micro_batches(
    total_lengths: np.ndarray, *, world_size: int, rank: int, max_tokens: int
) -> list[slice]:
    """This rank's micro-batches of a step: contiguous row ranges.

    Rows are first split into one contiguous shard per rank, balanced by tokens; every rank
    then takes the same number of micro-batches (collectives inside backward need equal
    counts), enough that the fullest shard stays near `max_tokens` per micro-batch. All
    ranks compute the same plan from the same verified rows, so no collective is needed.
    """
    n = len(total_lengths)
    if n < world_size:
        raise BatchVerificationError(
            f"the step has {n} rows, fewer than the {world_size} data-parallel ranks"
        )
    shard_bounds = _balanced_bounds(total_lengths, world_size)
    shards = list(zip(shard_bounds[:-1], shard_bounds[1:], strict=True))
    n_micro = max(-(-int(total_lengths[a:b].sum()) // max_tokens) for a, b in shards)
    n_micro = min(n_micro, min(b - a for a, b in shards))
    start, stop = shards[rank]
    inner = _balanced_bounds(total_lengths[start:stop], n_micro) + start
    return [slice(int(a), int(b)) for a, b in zip(inner[:-1], inner[1:], strict=True)]


def _balanced_bounds(weights: np.ndarray, parts: int) -> np.ndarray:
    """`parts + 1` cut points splitting `weights` into non-empty runs of similar sum."""
    n = len(weights)
    cum = np.cumsum(weights)
    k = np.arange(1, parts)
    cuts = np.searchsorted(cum, cum[-1] * k / parts, side="left") + 1
    # Cut k must leave k rows before it and parts-k after it; shifting by k turns
    # "strictly increasing" into "non-decreasing", which maximum.accumulate restores.
    shifted = np.maximum.accumulate(np.clip(cuts - k, 0, n - parts))
    return np.concatenate([[0], shifted + k, [n]]).astype(np.int64)
