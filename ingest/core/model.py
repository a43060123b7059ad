"""Plain data of the pure core: fragments, rollouts and groups as the processor assembles them.

Nothing here knows Kafka or Delta; the group stage fills these from events, replay fills
them from the `events` archive, and unit tests build them by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RolloutStatus = Literal["completed", "truncated", "aborted"]
Decision = Literal["kept", "dropped", "surplus"]
# An event's read-only numpy array, or a list in hand-built tests.
TokenValues = np.ndarray | Sequence[int]
LogProbValues = np.ndarray | Sequence[float]


@dataclass(slots=True)
class Fragment:
    """One training sample: a whole rollout, or one piece of a compacted rollout.

    Token arrays are the events' read-only numpy arrays (lists in hand-built tests): they
    reach Arrow without a Python object per token.
    """

    rollout_id: int
    fragment_index: int
    prompt_tokens: TokenValues
    response_tokens: TokenValues
    loss_mask: TokenValues | None = None  # None means all ones
    rollout_log_probs: LogProbValues | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response_text: str | None = None  # from sample_finished; Miles `Sample.response`
    event_id: str | None = None  # the event that carried it

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def effective_response_length(self) -> int:
        """Loss-masked tokens (Miles `effective_response_length`)."""
        if self.loss_mask is None:
            return self.response_length
        return int(np.count_nonzero(self.loss_mask))  # a 0/1 mask: its sum


@dataclass(slots=True)
class Rollout:
    """One trajectory (episode) of a group, with all fragments that have arrived so far."""

    rollout_id: int
    fragments: dict[int, Fragment] = field(default_factory=dict)
    fragment_count: int | None = None  # known once sample_finished arrived
    status: RolloutStatus | None = None  # None until finished or aborted
    sample_index: int | None = None
    reward: Any = None  # int / float / bool / dict / None, as sent
    reward_known: bool = False  # a null reward is known (scoring failed)
    weight_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    abort_reason: str | None = None

    @property
    def aborted(self) -> bool:
        return self.status == "aborted"

    @property
    def complete(self) -> bool:
        """Aborted, or every fragment present with a known reward (null included)."""
        if self.aborted:
            return True
        return (
            self.status is not None
            and self.fragment_count is not None
            and len(self.fragments) == self.fragment_count
            and self.reward_known
        )

    def ordered_fragments(self) -> list[Fragment]:
        return [self.fragments[i] for i in sorted(self.fragments)]


@dataclass(slots=True)
class Group:
    """The `n_samples` rollouts of one prompt in one run."""

    run_id: str
    group_index: int
    step: int | None = None  # from group_started
    n_samples: int | None = None  # from group_started
    started: bool = False
    prompt: Any = None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    rollouts: dict[int, Rollout] = field(default_factory=dict)
    first_event_at: float = 0.0  # event time of the first event, seconds since the epoch

    @property
    def complete(self) -> bool:
        return (
            self.started
            and self.n_samples is not None
            and len(self.rollouts) == self.n_samples
            and all(r.complete for r in self.rollouts.values())
        )

    def ordered_rollouts(self) -> list[Rollout]:
        """Rollouts in Miles order: by `sample_index` where known, else by `rollout_id`."""
        return sorted(
            self.rollouts.values(),
            key=lambda r: (r.sample_index is None, r.sample_index or 0, r.rollout_id),
        )


@dataclass(frozen=True, slots=True)
class FilterVerdict:
    """What the filter chain decided for one group (before step assignment)."""

    keep: bool
    reason: str | None = None
    counted: bool = True  # Miles: a drop with a None/empty reason is not counted
