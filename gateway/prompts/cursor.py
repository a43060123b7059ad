"""The prompt cursor of a run and the pure order it serves in (MILES_SEMANTICS 3.3/3.4).

Recycled groups first (FIFO), then the dataset in epoch order, epoch e being
`numpy.random.default_rng(seed + e).permutation(n)` of the original rows (or the original
order with `rollout_shuffle: false`). A request may wrap any number of epochs. No I/O:
the service keeps cursors durable (`gateway.prompts.checkpoints`, `gateway.prompts.wal`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from schemas.errors import InconsistentStateError

# group index -> every (dataset, version, row) a `group_started` of that group names.
LoggedRows = Mapping[int, set[tuple[str, int | None, int]]]


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

    def describe(self) -> dict[str, Any]:
        """The cursor as the API shows it (`PromptCursor`)."""
        return {
            "dataset": self.dataset, "dataset_version": self.dataset_version,
            "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch,
            "offset": self.offset, "next_group_index": self.next_group_index,
            "recycle_groups": list(self.recycle_groups), "seq": self.seq,
        }


@dataclass(frozen=True)
class Issued:
    """One group handed out: its index, the dataset row it serves, and where it came from."""

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


def roll_forward(base: Cursor, n_rows: int, logged: LoggedRows) -> tuple[Cursor, list[Issued]]:
    """`base` moved over the logged groups that follow it without a gap, checking that
    each replayed row is the one its `group_started` named.

    Groups past the first index missing from the log belong to a failed batch nobody
    received; they are issued again. A replayed row the log does not name means the
    checkpoint and the log disagree: InconsistentStateError."""
    end = base.next_group_index
    while end in logged:
        end += 1
    cursor, issued = take(base, n_rows, end - base.next_group_index)
    for item in issued:
        if (base.dataset, base.dataset_version, item.row) not in logged[item.group_index]:
            raise InconsistentStateError(
                f"cannot restore the prompt cursor of run {base.run_id!r}: group "
                f"{item.group_index} was published with prompt {sorted(logged[item.group_index])}"
                f", the replay gives row {item.row}")
    return cursor, issued
