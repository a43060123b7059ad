"""How long a processor did not run, from its own log: on a starved machine (CI's three
workers on two cores) every process can stand still for seconds at a time, and a bound on
how fast a processor reacts counts only the time it ran."""

from __future__ import annotations

import re
from datetime import datetime

# ingest.processor.health.FreezeWatch's line, in the processor's log format
FREEZE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO ingest\.processor\.health: "
                         r"the process did not run for ([0-9.]+) s$", re.MULTILINE)


def frozen_seconds(log: str, since: float, until: float) -> float:
    """Seconds of [since, until] (wall clock) in which a process writing `log` (the group
    stage's or the batch stage's, which share one stderr) reported it did not run."""
    spans = []
    for at, seconds in FREEZE_LINE.findall(log):
        end = datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        spans.append((max(since, end - float(seconds)), min(until, end)))
    total, reach = 0.0, since
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total
