"""Batch sealing for one run: step assignment, surplus, advantages and step metrics.

`RunBatcher` is a deterministic state machine over the run's decisions in order: the same
decisions give the same batches, byte for byte, which is what makes restarts exact. It
returns rows to write; it never writes.

Step metrics are written when a step *closes*, not when it seals: a sealed step closes
once a later step of the run has sealed (or the processor flushes on shutdown). By then the groups
cancelled at the seal and the surplus that finished after it have been decided, so the
bias-aware counts of a step describe that step.

After each decision the batcher also says how many more groups each open step it touched
needs (`Demand`, CONTRACT section 1): `rollout_batch_size - kept - in_flight`, floored at
0, where `kept` is the kept groups in the step's batch and `in_flight` the groups issued
for that step (their `group_started` archived) and not decided yet; `issued` counts the
step's groups issued so far, decided or not. A step's demand is reported only when its
`groups_needed` or `kept` differs from the last one reported, and never for a sealed step
(its `step_sealed` says it all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ingest.core.bias_metrics import GroupSummary, bias_metrics
from ingest.core.decide import reason_at_seal
from ingest.core.decided import DecidedGroup, DecisionHeader, Opened
from ingest.core.metrics import (
    MetricRow,
    batch_metrics,
    drop_reason_metrics,
    raw_reward_unfiltered,
)
from ingest.core.model import FilterVerdict
from ingest.core.reasons import CANCELLED_AT_SEAL
from ingest.core.rows import SealedBatch, group_row, sample_rows, training_rows
from schemas.events import RunConfig
from schemas.tables import content_sha256


@dataclass(slots=True)
class StepWindow:
    """What the metrics of one step are computed from, gathered until the step closes."""

    verdicts: list[FilterVerdict] = field(default_factory=list)
    offered_rewards: list[list[Any]] = field(default_factory=list)
    offered: int = 0
    kept: int = 0
    surplus: int = 0
    decided: list[GroupSummary] = field(default_factory=list)
    issued: int = 0  # group_started notices for the step
    first_event_at: float | None = None
    batch: dict[str, float] = field(default_factory=dict)
    sealed_at: float | None = None


@dataclass(slots=True)
class Effects:
    """Rows one decision produces; the I/O shell tags them with the decision's offset."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    samples: list[pa.Table] = field(default_factory=list)
    sealed: list[SealedBatch] = field(default_factory=list)
    closed: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    demands: list[StepDemand] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        self.groups.extend(other.groups)
        self.samples.extend(other.samples)
        self.sealed.extend(other.sealed)
        self.closed.extend(other.closed)
        self.demands.extend(other.demands)


@dataclass(frozen=True, slots=True)
class StepDemand:
    """An open step's need for more groups after a decision (the `demand` message)."""

    step: int
    groups_needed: int
    kept: int
    in_flight: int
    issued: int


class RunBatcher:
    """Assigns one run's decided groups to steps and seals batches of `rollout_batch_size`."""

    def __init__(self, run_id: str, config: RunConfig):
        self.run_id = run_id
        self.config = config
        self.decided: set[int] = set()
        self.sealed: dict[int, float] = {}  # step -> sealed_at
        self.closed: set[int] = set()
        self.kept: dict[int, list[DecidedGroup]] = {}  # open step -> kept groups
        # open step -> the run's config when the step got its first kept group: a later
        # run_started applies to the steps opened after it, so an open step never waits
        # for a batch size that its members already passed.
        self.step_configs: dict[int, RunConfig] = {}
        self.windows: dict[int, StepWindow] = {}
        self.opened: set[int] = set()
        self.in_flight: dict[int, set[int]] = {}  # step -> issued groups not decided yet
        self.demanded: dict[int, tuple[int, int]] = {}  # open step -> last (needed, kept)

    # -- state ---------------------------------------------------------------------------

    def window(self, step: int) -> StepWindow | None:
        if step in self.closed:
            return None
        return self.windows.setdefault(step, StepWindow())

    def target_step(self, step: int) -> int | None:
        """The oldest open step within `max_staleness` of `step`, or None (surplus)."""
        for candidate in range(step, step + self.config.max_staleness + 1):
            if candidate not in self.sealed:
                return candidate
        return None

    # -- transitions ---------------------------------------------------------------------

    def apply(self, item: Opened | DecidedGroup) -> Effects:
        """Apply one item in `OrderKey` order, as the batch stage and replay do; a
        decision seals at the event time it is ordered by."""
        if isinstance(item, Opened):
            self.open(item.group_index, item.step, item.at_us / 1e6)
            return Effects()
        return self.offer(item, now=item.header.ordered_at)

    def open(self, group_index: int, step: int, at: float) -> None:
        """A group was issued for `step` (its group_started was archived)."""
        if group_index in self.opened:
            return
        self.opened.add(group_index)
        if group_index not in self.decided and step not in self.sealed:
            self.in_flight.setdefault(step, set()).add(group_index)
        window = self.window(step)
        if window is not None:
            window.issued += 1
            if window.first_event_at is None or at < window.first_event_at:
                window.first_event_at = at

    def offer(self, group: DecidedGroup, now: float) -> Effects:
        """Apply one decision. A repeated decision for a decided group changes nothing."""
        header = group.header
        effects = Effects()
        if header.group_index in self.decided:
            return effects
        self.decided.add(header.group_index)
        step = header.step
        if step is not None:
            self.in_flight.get(step, set()).discard(header.group_index)
        decision, batch_step = header.decision, None
        reason = reason_at_seal(header, None if step is None else self.sealed.get(step))
        if decision == "kept":
            assert step is not None  # kept groups always had their group_started
            batch_step = self.target_step(step)
            if batch_step is None:
                decision = "surplus"
        self._account(header, group.fragments, decision, reason)
        effects.groups.append(group_row(header, decision, reason, batch_step, group.fragments))
        effects.samples.append(sample_rows(header, group.fragments, decision, reason))
        if batch_step is not None:
            members = self.kept.setdefault(batch_step, [])
            config = self.step_configs.setdefault(batch_step, self.config)
            members.append(group)
            if len(members) == config.rollout_batch_size:
                effects.extend(self._seal(batch_step, now))
        for touched in sorted({s for s in (step, batch_step) if s is not None}):
            demand = self._demand(touched)
            if demand is not None:
                effects.demands.append(demand)
        return effects

    def _demand(self, step: int) -> StepDemand | None:
        """The step's demand when it changed since the last one reported; None for a
        sealed step or an unchanged demand."""
        if step in self.sealed:
            return None
        size = self.step_configs.get(step, self.config).rollout_batch_size
        kept = len(self.kept.get(step, ()))
        in_flight = len(self.in_flight.get(step, ()))
        window = self.window(step)
        issued = window.issued if window is not None else 0
        needed = max(0, size - kept - in_flight)
        if self.demanded.get(step) == (needed, kept):
            return None
        self.demanded[step] = (needed, kept)
        return StepDemand(step, needed, kept, in_flight, issued)

    def _account(self, header: DecisionHeader, fragments: pa.Table, decision: str,
                 reason: str | None) -> None:
        if header.step is None:
            return
        window = self.window(header.step)
        if window is None:
            return  # decided after its step closed: in the tables, not in the metrics
        if window.first_event_at is None or header.first_event_at < window.first_event_at:
            window.first_event_at = header.first_event_at
        window.decided.append(
            GroupSummary(decision, reason, fragments.column("response_length").to_pylist(),
                      fragments.column("status").to_pylist(),
                      cancelled_at_seal=reason == CANCELLED_AT_SEAL)
        )
        if reason == CANCELLED_AT_SEAL:
            return  # cancelled by the seal itself: never offered to the filter chain
        if not header.offered:
            window.verdicts.append(FilterVerdict(False, reason, True))
            return
        window.offered += 1
        rewards = [
            None if r is None else orjson.loads(r) for r in fragments.column("reward_json").to_pylist()
        ]
        window.offered_rewards.append(rewards)
        if decision == "dropped":
            window.verdicts.append(FilterVerdict(False, reason, header.counted))
        elif decision == "surplus":
            window.surplus += 1
        else:
            window.kept += 1

    def _seal(self, step: int, now: float) -> Effects:
        members = self.kept.pop(step)
        config = self.step_configs.pop(step)
        self.sealed[step] = now
        self.demanded.pop(step, None)
        self.in_flight.pop(step, None)
        members.sort(key=_batch_order)
        rows = training_rows(self.run_id, step, members, config)
        sealed = SealedBatch(
            step=step,
            rows=rows,
            n_groups=len(members),
            n_rollouts=sum(len(set(m.fragments.column("rollout_id").to_pylist())) for m in members),
            n_tokens=int(pc.sum(pc.list_value_length(rows.column("response_tokens"))).as_py() or 0),
            sealed_at=now,
            content_sha256=content_sha256(rows),
        )
        window = self.window(step)
        if window is not None:
            window.sealed_at = now
            window.batch = batch_metrics(
                _metric_rows(members),
                reward_key=config.reward_key,
                advantage_estimator=config.advantage_estimator,
            )
        effects = Effects(sealed=[sealed])
        # A sealed step closes once any later step has sealed; steps may seal out of order
        # (kept groups of several steps in flight), so compare with the latest seal.
        latest = max(self.sealed)
        earlier = [s for s in self.sealed if s < latest and s not in self.closed]
        effects.closed.extend(self._close(s) for s in sorted(earlier))
        return effects

    def _close(self, step: int) -> tuple[int, dict[str, float]]:
        window = self.windows.pop(step, StepWindow())
        self.closed.add(step)
        return step, step_metrics(window, self.config)

    def flush(self) -> Effects:
        """Close every sealed step (shutdown): its metrics are as complete as they get."""
        pending = sorted(s for s in self.sealed if s not in self.closed)
        return Effects(closed=[self._close(s) for s in pending])


def step_metrics(window: StepWindow, config: RunConfig) -> dict[str, float]:
    """CONTRACT section 5 keys of one closed step."""
    out: dict[str, float] = {}
    out.update(drop_reason_metrics(window.verdicts))
    out.update(raw_reward_unfiltered(window.offered_rewards, config.reward_key))
    out.update(window.batch)
    dropped = sum(1 for v in window.verdicts if not v.keep)
    out["rollout/groups_offered"] = float(window.offered)
    out["rollout/groups_kept"] = float(window.kept)
    out["rollout/groups_surplus"] = float(window.surplus)
    out["rollout/groups_dropped"] = float(dropped)
    out["rollout/groups_cancelled"] = float(sum(g.cancelled_at_seal for g in window.decided))
    out["rollout/prompts_issued"] = float(window.issued)
    out.update(bias_metrics(window.decided, groups_issued=window.issued))
    if window.sealed_at is not None and window.first_event_at is not None:
        out["perf/rollout_time"] = max(0.0, window.sealed_at - window.first_event_at)
    return out


def _batch_order(group: DecidedGroup) -> tuple[int, int]:
    """Rows of a step are ordered by the first `sample_index` of their group (else index)."""
    indices = [i for i in group.fragments.column("sample_index").to_pylist() if i is not None]
    first = min(indices) if indices else group.header.group_index
    return first, group.header.group_index


_METRIC_COLUMNS = ["rollout_id", "sample_index", "reward_json", "response_length",
                   "effective_length", "status", "metadata_json"]


def _metric_rows(members: list[DecidedGroup]) -> list[MetricRow]:
    rows = []
    for member in members:
        # Only the scalar columns: converting the token lists to Python would dominate.
        f = member.fragments.select(_METRIC_COLUMNS).to_pydict()
        for i in range(member.fragments.num_rows):
            rows.append(
                MetricRow(
                    group_index=member.header.group_index,
                    rollout_id=f["rollout_id"][i],
                    sample_index=f["sample_index"][i],
                    reward=None if f["reward_json"][i] is None else orjson.loads(f["reward_json"][i]),
                    response_length=f["response_length"][i],
                    effective_response_length=f["effective_length"][i],
                    status=f["status"][i],
                    metadata=orjson.loads(f["metadata_json"][i]) if f["metadata_json"][i] else {},
                )
            )
    return rows


