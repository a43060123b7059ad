"""Sealed steps from Delta to torch: follow `steps`, read the pinned batch, verify, tensorise.

The trainer trusts nothing it did not verify: a step's `training_batches` rows are read at
the `batch_version` its `steps` row recorded, and must hash to its `content_sha256`
(`schemas.tables.content_sha256` over the rows in position order) before they become
tensors. Tensorisation is vectorised over Arrow buffers; there is no Python loop per row
or token, so a 4M-token step converts in well under a second.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ingest.lake import Lake
from schemas.errors import BatchVerificationError
from schemas.tables import STEPS, TRAINING_BATCHES, content_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealedStep:
    """The `steps` row of one sealed step: where its batch is and what it must hash to."""

    run_id: str
    step: int
    batch_version: int
    content_sha256: str
    n_samples: int

    @classmethod
    def from_row(cls, row: dict) -> SealedStep:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


class StepFollower:
    """Polls a run's `steps` table for sealed steps."""

    def __init__(self, lake: Lake, run_id: str, *, poll_interval_s: float):
        self.lake = lake
        self.run_id = run_id
        self.poll_interval_s = poll_interval_s

    def _steps(self, step: int | None = None) -> pa.Table:
        where = pc.field("run_id") == self.run_id
        if step is not None:
            where &= pc.field("step") == step
        return self.lake.read(STEPS.name, filter=where)

    def sealed(self, step: int) -> SealedStep | None:
        rows = self._steps(step).to_pylist()
        if len(rows) > 1:
            raise BatchVerificationError(
                f"run {self.run_id} step {step}: the steps table holds {len(rows)} rows, expected 1"
            )
        return SealedStep.from_row(rows[0]) if rows else None

    def wait_for(self, step: int | None, *, idle_timeout_s: float | None) -> SealedStep | None:
        """Block until `step` (or, when None, the lowest step of the run) is sealed.

        Returns None once `idle_timeout_s` passed without it.
        """
        deadline = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
        waiting_logged = False
        while True:
            if step is None:
                steps = self._steps().column("step")
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
            time.sleep(self.poll_interval_s)


def read_sealed_rows(lake: Lake, sealed: SealedStep) -> pa.Table:
    """The step's `training_batches` rows at its recorded version, verified, in position order."""
    rows = lake.read(
        TRAINING_BATCHES.name,
        filter=(pc.field("run_id") == sealed.run_id) & (pc.field("step") == sealed.step),
        version=sealed.batch_version,
    )
    positions = rows.column("position").to_numpy()
    # Files come back in commit order, usually already sorted; sorting copies every list
    # column, so it only happens when needed.
    if np.any(positions[1:] <= positions[:-1]):
        rows = rows.sort_by("position")
    verify_rows(sealed, rows)
    return rows


def verify_rows(sealed: SealedStep, rows: pa.Table) -> None:
    where = (
        f"run {sealed.run_id} step {sealed.step} (training_batches version {sealed.batch_version})"
    )
    if rows.num_rows != sealed.n_samples:
        raise BatchVerificationError(
            f"{where}: read {rows.num_rows} rows, the steps table recorded {sealed.n_samples}"
        )
    positions = rows.column("position").to_numpy()
    if not np.array_equal(positions, np.arange(rows.num_rows)):
        raise BatchVerificationError(f"{where}: positions are not 0..{rows.num_rows - 1}")
    digest = content_sha256(rows)
    if digest != sealed.content_sha256:
        raise BatchVerificationError(
            f"{where}: content_sha256 of the rows is {digest}, the steps table recorded "
            f"{sealed.content_sha256}; the batch was changed after sealing"
        )


@dataclass(frozen=True)
class StepBatch:
    """One step as right-padded tensors.

    `tokens`/`attention_mask` are [B, L] (prompt then response). Per-token training
    tensors are [B, L-1], aligned with the logits that predict `tokens[:, 1:]`, so index t
    scores token t+1. `response_mask` marks trainable response positions, `loss_mask` the
    ones the loss counts. `rollout_index` numbers the step's rollouts (group_index,
    rollout_id) 0..n_rollouts-1; `rollout_mask_sums` is D_i, the loss-mask sum over every
    row of row i's rollout, so compaction siblings share one denominator.
    """

    step: int
    tokens: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
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

    def rows(self, part: slice) -> StepBatch:
        """Rows `part`, with the padding trimmed to their longest sequence."""
        length = int(self.total_lengths[part].max())
        return StepBatch(
            step=self.step,
            tokens=self.tokens[part, :length],
            attention_mask=self.attention_mask[part, :length],
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
    row = np.arange(n, dtype=np.int64)
    prompt_start = np.cumsum(prompt_len) - prompt_len
    resp_start = np.cumsum(resp_len) - resp_len

    # Flat indices into the [n, width] token matrix: value k of row i lands at
    # i*width + (k - start_i) (+ prompt_len_i for response tokens).
    tokens = np.zeros(n * width, dtype=np.int64)
    tokens[np.arange(prompt_vals.size) + np.repeat(row * width - prompt_start, prompt_len)] = (
        prompt_vals
    )
    resp_flat = np.arange(resp_vals.size) + np.repeat(
        row * width + prompt_len - resp_start, resp_len
    )
    tokens[resp_flat] = resp_vals

    # Response token at absolute position p is scored by the logits at p-1, i.e. index
    # i*(width-1) + p - 1 of the [n, width-1] target grid. A response token at position 0
    # (empty prompt) has no context and is not trained.
    resp_row = np.repeat(row, resp_len)
    target = resp_flat - resp_row - 1
    trainable = resp_flat - resp_row * width > 0
    target_t = target[trainable]
    grid = n * (width - 1)

    response_mask = np.zeros(grid, dtype=bool)
    response_mask[target_t] = True
    loss_mask = np.zeros(grid, dtype=np.float32)
    loss_mask[target_t] = mask_vals[trainable]
    old_log_probs = np.zeros(grid, dtype=np.float32)
    # Null lists contribute no values, so lp_vals lines up with the rows that have them.
    in_lp_row = np.repeat(has_lp, resp_len)
    old_log_probs[target[in_lp_row & trainable]] = lp_vals[trainable[in_lp_row]]

    row_mask_sums = np.bincount(resp_row[trainable], weights=loss_mask[target_t], minlength=n)
    keys = np.stack(
        [rows.column("group_index").to_numpy(), rows.column("rollout_id").to_numpy()], axis=1
    )
    uniq, rollout_index = np.unique(keys, axis=0, return_inverse=True)
    rollout_index = rollout_index.reshape(-1)
    rollout_sums = np.bincount(rollout_index, weights=row_mask_sums)[rollout_index]

    advantages = torch.from_numpy(rows.column("advantage").to_numpy().astype(np.float32))
    shape = (n, width - 1)
    return StepBatch(
        step=step,
        tokens=torch.from_numpy(tokens.reshape(n, width)),
        attention_mask=torch.from_numpy(
            (np.arange(width)[None, :] < total_len[:, None]).astype(np.int64)
        ),
        response_mask=torch.from_numpy(response_mask.reshape(shape)),
        loss_mask=torch.from_numpy(loss_mask.reshape(shape)),
        advantages=advantages[:, None].expand(shape),
        old_log_probs=torch.from_numpy(old_log_probs.reshape(shape)),
        has_old_log_probs=torch.from_numpy(has_lp.copy()),
        total_lengths=torch.from_numpy(total_len),
        response_lengths=torch.from_numpy(np.bincount(resp_row[trainable], minlength=n)),
        rollout_index=torch.from_numpy(rollout_index.astype(np.int64)),
        rollout_mask_sums=torch.from_numpy(rollout_sums.astype(np.float32)),
        n_rollouts=len(uniq),
    )


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
