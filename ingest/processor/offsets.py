"""App-transaction ids: how far each table has written each source partition.

The ids name table, topic and partition (`events@rollout.events:0`), so every table
records independently how far each source partition has been written (exactly once,
as kafka-delta-ingest does).
"""

from __future__ import annotations


def app_id(table: str, topic: str, partition: int) -> str:
    return f"{table}@{topic}:{partition}"
