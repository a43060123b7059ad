"""Deciding a group: the one place a group and its run's config become a decision.

`decide` turns a complete (or timed-out) group into the `DecidedGroup` the batch stage
applies: the filter chain's verdict, or `group_timeout`, `filter_error`, `unstorable`.
The group stage calls it live and after a restart, `rolloutlake replay` over the archive.

Cancelled at seal is decided in two halves that live here together, because the group
stage does not know when a step seals and the batch stage no longer has the events:
`decide` records in the header when the group's cancellations began (`cancel_min_ts`,
only when every abort of the group is a `cancelled` one), and `reason_at_seal` turns a
`group_has_aborted` drop into `cancelled_at_seal` once the batch stage knows the seal
time of the group's step: cancelled at or after the seal means the seal cut it short.
"""

from __future__ import annotations

from dataclasses import dataclass

from ingest.core.decided import FRAGMENTS, DecidedGroup, DecisionHeader, fragments_table
from ingest.core.filters import FilterArgs, apply_filter_chain, load_filter
from ingest.core.model import FilterVerdict, Group
from ingest.core.reasons import (
    CANCELLED_AT_SEAL,
    FILTER_ERROR,
    GROUP_HAS_ABORTED,
    GROUP_TIMEOUT,
    UNSTORABLE,
)
from schemas.errors import RolloutlakeError
from schemas.events import RunConfig


@dataclass(frozen=True, slots=True)
class Decided:
    """A decision, and why the group was dropped `filter_error` or `unstorable` (the
    caller dead-letters it with this error); None otherwise."""

    group: DecidedGroup
    error: str | None = None


def decide(group: Group, config: RunConfig, *, at_us: int, source: dict[str, int],
           decided_at: float, timed_out: bool = False) -> Decided:
    """Decide one group of a run under `config`.

    A complete group goes through the filter chain (a user filter that raises, or does not
    load, drops it `filter_error`); a timed-out one is `group_timeout`, never offered. A
    decision that cannot be built or encoded drops the group `unstorable`, with no
    fragments. `at_us` is the event time the decision is ordered by, `source` the events
    partition and offset deciding it (offset -1 for a timeout).
    """
    error = None
    if timed_out:
        verdict = FilterVerdict(False, GROUP_TIMEOUT)
    else:
        try:
            user_filter = load_filter(config.resolved_filter_path)
            verdict = apply_filter_chain(FilterArgs.from_config(config), group, user_filter)
        except Exception as err:  # noqa: BLE001 - a user filter may raise anything
            error = (str(err) if isinstance(err, RolloutlakeError) else
                     f"filter {config.dynamic_sampling_filter_path} raised "
                     f"{type(err).__name__}: {err}")
            verdict = FilterVerdict(False, FILTER_ERROR)
    offered = not timed_out
    try:
        header = _header(group, verdict, decided_at=decided_at, source=source, at_us=at_us,
                         offered=offered)
        fragments = fragments_table(group, config.reward_key, with_tokens=verdict.keep)
        header.to_json()  # fails here, not after the archive commit, if it cannot encode
    except Exception as err:  # noqa: BLE001 - a group that cannot be stored is dropped
        error = (f"group {group.group_index} of run {group.run_id} cannot be stored: "
                 f"{type(err).__name__}: {err}")
        header = _header(group, FilterVerdict(False, UNSTORABLE), decided_at=decided_at,
                         source=source, at_us=at_us, offered=offered)
        fragments = FRAGMENTS.empty_table()
    return Decided(DecidedGroup(header, fragments), error)


def cancelled_since(group: Group) -> float | None:
    """The earliest `ts` of the group's aborts when every abort is a `cancelled` one with
    a `ts`; None otherwise (no abort, another reason, or a time missing)."""
    aborts = [r for r in group.rollouts.values() if r.aborted]
    if not aborts or any(r.abort_reason != "cancelled" for r in aborts):
        return None
    stamps = [s for r in aborts if isinstance(s := r.metadata.get("abort_ts"), int | float)]
    if len(stamps) < len(aborts):
        return None
    return float(min(stamps))


def reason_at_seal(header: DecisionHeader, sealed_at: float | None) -> str | None:
    """The group's reason once its step's seal time is known (None: not sealed yet)."""
    if (header.decision == "dropped" and header.reason == GROUP_HAS_ABORTED
            and header.cancel_min_ts is not None and sealed_at is not None
            and header.cancel_min_ts >= sealed_at):
        return CANCELLED_AT_SEAL
    return header.reason


def _header(group: Group, verdict: FilterVerdict, *, decided_at: float,
            source: dict[str, int], at_us: int, offered: bool) -> DecisionHeader:
    return DecisionHeader(
        run_id=group.run_id,
        group_index=group.group_index,
        step=group.step,
        n_samples=group.n_samples,
        decision="kept" if verdict.keep else "dropped",
        reason=verdict.reason,
        counted=verdict.counted,
        decided_at=decided_at,
        first_event_at=group.first_event_at,
        cancel_min_ts=cancelled_since(group),
        offered=offered,
        source=source,
        at_us=at_us,
    )
