"""Group assembly: fold trajectory events, in any order, into `Group`s.

Each event is either applied, recognised as a duplicate (same `event_id`, applied once),
or rejected with a readable reason (the caller dead-letters it). An event is applied
whole or not at all, so a rejected event never half-changes a group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, assert_never

from ingest.core.model import Fragment, Group, Rollout
from schemas.events import (
    CompactionFragment,
    GroupStarted,
    RewardEvent,
    SampleAborted,
    SampleFinished,
    TrajectoryEvent,
)

ApplyStatus = Literal["applied", "duplicate", "rejected"]


@dataclass(frozen=True, slots=True)
class ApplyResult:
    status: ApplyStatus
    reason: str | None = None
    # (event id, reason) of earlier `compaction_fragment`s this event proved out of range
    # (fragment_index >= the fragment_count it carries): they left the group and the
    # caller dead-letters them.
    evicted: tuple[tuple[str, str], ...] = ()

    @property
    def accepted(self) -> bool:
        return self.status == "applied"


APPLIED = ApplyResult("applied")
DUPLICATE = ApplyResult("duplicate")


def _reject(reason: str) -> ApplyResult:
    return ApplyResult("rejected", reason)


class GroupBuilder:
    """One group under assembly plus the event ids already applied to it."""

    __slots__ = ("group", "event_ids")

    def __init__(self, run_id: str, group_index: int, first_event_at: float):
        self.group = Group(run_id=run_id, group_index=group_index, first_event_at=first_event_at)
        self.event_ids: set[str] = set()

    def apply(self, event: TrajectoryEvent) -> ApplyResult:
        if event.event_id in self.event_ids:
            return DUPLICATE
        if isinstance(event, GroupStarted):
            result = self._group_started(event)
        else:
            result = self._rollout_event(event)
        if result.accepted:
            # An evicted fragment's id stays known: a redelivery of it is a duplicate.
            self.event_ids.add(event.event_id)
        return result

    def _group_started(self, event: GroupStarted) -> ApplyResult:
        group = self.group
        if group.started:
            return _reject(f"group {group.group_index} already has a group_started event")
        if len(group.rollouts) > event.n_samples:
            return _reject(
                f"group {group.group_index} already has {len(group.rollouts)} rollouts, "
                f"more than n_samples={event.n_samples}"
            )
        group.started = True
        group.step = event.step
        group.n_samples = event.n_samples
        group.prompt = event.prompt
        group.label = event.label
        group.metadata = dict(event.metadata)
        return APPLIED

    def _rollout_for(self, rollout_id: int) -> Rollout | ApplyResult:
        group = self.group
        rollout = group.rollouts.get(rollout_id)
        if rollout is not None:
            return rollout
        if group.n_samples is not None and len(group.rollouts) >= group.n_samples:
            return _reject(
                f"rollout {rollout_id} exceeds the group's n_samples={group.n_samples} "
                f"(rollouts {sorted(group.rollouts)} already present)"
            )
        return Rollout(rollout_id=rollout_id)

    def _rollout_event(
        self, event: SampleFinished | CompactionFragment | RewardEvent | SampleAborted
    ) -> ApplyResult:
        found = self._rollout_for(event.rollout_id)
        if isinstance(found, ApplyResult):
            return found
        rollout = found
        if isinstance(event, SampleFinished):
            result = _apply_finished(rollout, event)
        elif isinstance(event, CompactionFragment):
            result = _apply_fragment(rollout, event)
        elif isinstance(event, RewardEvent):
            result = _apply_reward(rollout, event.reward)
        elif isinstance(event, SampleAborted):
            result = _apply_aborted(rollout, event)
        else:
            assert_never(event)
        if result.accepted:
            self.group.rollouts[rollout.rollout_id] = rollout
        return result


def _fragment(event: SampleFinished | CompactionFragment, index: int) -> Fragment:
    return Fragment(
        rollout_id=event.rollout_id,
        fragment_index=index,
        prompt_tokens=event.prompt_tokens,
        response_tokens=event.response_tokens,
        loss_mask=event.loss_mask,
        rollout_log_probs=event.rollout_log_probs,
        metadata=event.metadata,
        response_text=event.response_text if isinstance(event, SampleFinished) else None,
        event_id=event.event_id,
    )


def _same_reward(a: object, b: object) -> bool:
    # 1 and 1.0 are the same score; True and 1 are not the same event payload.
    return type(a) is type(b) and a == b or (
        isinstance(a, int | float) and isinstance(b, int | float)
        and not isinstance(a, bool) and not isinstance(b, bool) and a == b
    )


def _apply_finished(rollout: Rollout, event: SampleFinished) -> ApplyResult:
    if rollout.aborted:
        return _reject(f"rollout {event.rollout_id} was already aborted")
    if rollout.status is not None:
        return _reject(f"rollout {event.rollout_id} already has a sample_finished event")
    index = event.resolved_fragment_index
    if index in rollout.fragments:
        return _reject(f"rollout {event.rollout_id} already has fragment {index}")
    if event.has_reward and rollout.reward_known and not _same_reward(rollout.reward, event.reward):
        return _reject(
            f"conflicting reward for rollout {event.rollout_id}: {event.reward!r} after "
            f"{rollout.reward!r} (the first value stands)"
        )
    # Fragments accepted before the count was known and beyond it were never part of
    # the rollout: they leave it, so the rollout can complete.
    beyond = sorted(i for i in rollout.fragments if i >= event.fragment_count)
    evicted = tuple(
        (rollout.fragments.pop(i).event_id or "", _out_of_range(i, event.fragment_count))
        for i in beyond
    )
    rollout.fragments[index] = _fragment(event, index)
    rollout.status = event.status
    rollout.fragment_count = event.fragment_count
    rollout.sample_index = event.sample_index
    rollout.weight_version = event.weight_version
    rollout.metadata = dict(event.metadata)
    if event.has_reward and not rollout.reward_known:
        rollout.reward, rollout.reward_known = event.reward, True
    return ApplyResult("applied", evicted=evicted) if evicted else APPLIED


def _apply_fragment(rollout: Rollout, event: CompactionFragment) -> ApplyResult:
    if rollout.aborted:
        return _reject(f"rollout {event.rollout_id} was already aborted")
    if event.fragment_index in rollout.fragments:
        return _reject(f"rollout {event.rollout_id} already has fragment {event.fragment_index}")
    if rollout.fragment_count is not None and event.fragment_index >= rollout.fragment_count:
        return _reject(_out_of_range(event.fragment_index, rollout.fragment_count))
    rollout.fragments[event.fragment_index] = _fragment(event, event.fragment_index)
    return APPLIED


def _out_of_range(fragment_index: int, fragment_count: int) -> str:
    return (f"fragment_index {fragment_index} is not below the rollout's fragment_count "
            f"{fragment_count}")


def _apply_reward(rollout: Rollout, reward: object) -> ApplyResult:
    if rollout.aborted:
        return _reject(f"rollout {rollout.rollout_id} was already aborted")
    if rollout.reward_known:
        if _same_reward(rollout.reward, reward):
            return APPLIED
        return _reject(
            f"conflicting reward for rollout {rollout.rollout_id}: {reward!r} after "
            f"{rollout.reward!r} (the first value stands)"
        )
    rollout.reward, rollout.reward_known = reward, True
    return APPLIED


def _apply_aborted(rollout: Rollout, event: SampleAborted) -> ApplyResult:
    if rollout.status in ("completed", "truncated"):
        return _reject(f"rollout {event.rollout_id} already finished; it cannot be aborted")
    if rollout.aborted:
        return APPLIED  # a second abort says nothing new
    rollout.status = "aborted"
    rollout.abort_reason = event.reason
    rollout.metadata = {"abort_ts": event.ts} if event.ts is not None else {}
    if event.response_tokens is not None and not rollout.fragments:
        rollout.metadata["partial_response_length"] = len(event.response_tokens)
    return APPLIED


class ArchivedRow(Protocol):
    """An archived event as `fold_partition` reads it (`ingest.io.archive.ArchivedEvent`)."""

    @property
    def run_id(self) -> str: ...
    @property
    def group_index(self) -> int | None: ...  # None for run_started
    @property
    def offset(self) -> int: ...
    @property
    def at_us(self) -> int: ...

    def event(self) -> TrajectoryEvent: ...


@dataclass(slots=True)
class FoldedGroup:
    """A group folded from one partition's archived events."""

    builder: GroupBuilder
    first_us: int  # event time of its first archived event
    started: tuple[int, int, int] | None = None  # (event time, offset, step) of its group_started
    completed: tuple[int, int] | None = None  # (event time, offset) of the event completing it


def fold_partition(rows: Iterable[ArchivedRow],
                   skip: Callable[[str, int], bool]) -> dict[tuple[str, int], FoldedGroup]:
    """Fold one events partition's archived trajectory events, in offset order, into
    groups, as the group stage assembled them: the groups in order of their first event.

    The archive holds only events the group stage accepted, so every event applies as it
    did live. Groups `skip(run_id, group_index)` names (decided or dead-lettered) are left
    out without parsing their events.
    """
    groups: dict[tuple[str, int], FoldedGroup] = {}
    for row in rows:
        group_index = row.group_index
        if group_index is None or skip(row.run_id, group_index):
            continue
        key = (row.run_id, group_index)
        folded = groups.get(key)
        if folded is None:
            folded = groups[key] = FoldedGroup(
                GroupBuilder(row.run_id, group_index, row.at_us / 1e6), row.at_us)
        event = row.event()
        folded.builder.apply(event)
        if isinstance(event, GroupStarted):
            folded.started = (row.at_us, row.offset, event.step)
        if folded.completed is None and folded.builder.group.complete:
            folded.completed = (row.at_us, row.offset)
    return groups
