"""Durable partial rollout: groups cancelled at a seal wait on the compacted
`rollout.partial` topic (records: `schemas/partial.py`) until a later round continues them,
across restarts of the worker.

A record goes through three states, each written (and acknowledged) before the worker goes
on:

- `pending`: once every sample of the cancelled group is resolved;
- `claimed` (`as_group` g2, `as_step` s2): before the worker publishes anything of the
  continuing group g2;
- a tombstone once g2's events are acknowledged (and, when g2 was cancelled in its turn,
  after g2's own pending record).

A worker reads the run's records on start. Pending groups are continued first; a claimed
group was being continued when a worker died: it is continued again as the same group g2
in step s2 with the same event ids (`continuation_event_id`), so the processor, which
applies a repeated event id once, keeps what reached it first and each rollout is
continued exactly once.
"""

from __future__ import annotations

import orjson
from kafka import TopicPartition
from kafka.errors import KafkaError

from ingest.io.kafka import KafkaSettings
from ingest.workers.prompts import Prompt
from schemas.errors import BrokerUnavailableError
from schemas.partial import PartialGroup, PartialPrompt

# Tansu under-reports the end offset of multi-record batches: read until a quiet poll too.
POLL_MS = 200
QUIET_MS = 500
SEND_TIMEOUT_S = 30.0


def stored_prompt(prompt: Prompt) -> PartialPrompt:
    return PartialPrompt(text=prompt.text, label=prompt.label, metadata=prompt.metadata,
                         tokens=prompt.tokens)


def prompt_of(group: PartialGroup) -> Prompt:
    stored = group.prompt
    return Prompt(stored.text, stored.label, dict(stored.metadata), list(stored.tokens))


def continuation_event_id(run_id: str, origin: int, group_index: int, kind: str,
                          rollout_id: int | None = None) -> str:
    """The event id of one event of a continuing group: the same in every worker that
    continues cancelled group `origin` as `group_index`, so a repeat is applied once."""
    rollout = "" if rollout_id is None else f"-r{rollout_id}"
    return f"{run_id}-g{group_index}-from-g{origin}-{kind}{rollout}"


def loss_mask(versions: list[int], current: int, *, mask_offpolicy: bool) -> list[int]:
    """Ones, or with `mask_offpolicy` zeros for the tokens of weights older than `current`."""
    if not mask_offpolicy:
        return [1] * len(versions)
    return [0 if v < current else 1 for v in versions]


def plan_round(recycled: list[PartialGroup], step: int, indexes: list[int]
               ) -> tuple[list[tuple[int, int, PartialGroup]], list[PartialGroup]]:
    """Which recycled groups a round of `step` on group indexes `indexes` continues, as
    (group index, step, group), and those left for later rounds.

    Claimed groups are continued again as the group and step of their claim, whatever the
    round; pending ones take the round's indexes in the order they were recycled, left of
    the indexes the claims hold."""
    claimed = [(g.as_group, g.as_step, g) for g in recycled if g.state == "claimed"]
    taken = {index for index, _, _ in claimed}
    free = [index for index in indexes if index not in taken]
    pending = [g for g in recycled if g.state == "pending"]
    assigned = [(index, step, group) for index, group in zip(free, pending, strict=False)]
    return [*claimed, *assigned], pending[len(assigned):]  # type: ignore[list-item]


class PartialStore:
    """The run's records on `rollout.partial`: written synchronously, read back in full."""

    def __init__(self, settings: KafkaSettings, run_id: str):
        self.run_id = run_id
        self.topic = settings.topics.partial
        self._settings = settings
        self._producer = settings.producer()

    def close(self) -> None:
        self._producer.close()

    def load(self) -> list[PartialGroup]:
        """The run's pending and claimed groups, in the order they were recycled."""
        latest: dict[bytes, bytes | None] = {}
        recycled_at: dict[bytes, int] = {}
        prefix = f"{self.run_id}:".encode()
        consumer = self._settings.consumer()
        try:
            tp = TopicPartition(self.topic, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            end = consumer.end_offsets([tp])[tp]
            while True:
                polled = consumer.poll(POLL_MS)
                if not polled:
                    if consumer.position(tp) < end:
                        continue
                    polled = consumer.poll(QUIET_MS)
                    if not polled:
                        break
                for records in polled.values():
                    for record in records:
                        if not (record.key or b"").startswith(prefix):
                            continue
                        if record.value is None:  # continued: a later record is new
                            recycled_at.pop(record.key, None)
                        else:
                            recycled_at.setdefault(record.key, record.offset)
                        latest[record.key] = record.value
        except KafkaError as err:
            raise BrokerUnavailableError(f"could not read {self.topic}: {err}") from None
        finally:
            consumer.close()
        groups = [PartialGroup.model_validate(orjson.loads(value)) for _, value in sorted(
            (recycled_at[key], value) for key, value in latest.items() if value is not None)]
        # A claim whose continuing group has a record of its own was finished but for its
        # tombstone: the worker died between the two writes.
        recorded = {group.group_index for group in groups}
        for group in groups:
            if group.as_group in recorded:
                self.done(group.group_index)
        return [group for group in groups if group.as_group not in recorded]

    def put(self, group: PartialGroup) -> None:
        self._send(group.group_index, group.model_dump_json().encode())

    def claim(self, group: PartialGroup, as_group: int, as_step: int) -> PartialGroup:
        claimed = group.model_copy(update={"state": "claimed", "as_group": as_group,
                                           "as_step": as_step})
        self.put(claimed)
        return claimed

    def done(self, group_index: int) -> None:
        self._send(group_index, None)

    def _send(self, group_index: int, value: bytes | None) -> None:
        key = f"{self.run_id}:{group_index}".encode()
        try:
            self._producer.send(self.topic, key=key, value=value).get(timeout=SEND_TIMEOUT_S)
        except KafkaError as err:
            raise BrokerUnavailableError(
                f"could not write partial group {group_index} to {self.topic}: {err}") from None
