"""The terminal table of a run's sealed steps that `demo` and `replay` print."""

from __future__ import annotations

import pyarrow.compute as pc
from rich.table import Table

from ingest.core.reasons import ZERO_STD_PREFIX
from ingest.io.lake import Lake

DROP_PREFIX = "rollout/dynamic_filter/drop_"


def _label(reason: str) -> str:
    return (reason.removeprefix("group_has_").replace("missing_reward", "no reward")
            .replace(ZERO_STD_PREFIX, "all "))


def step_table(lake: Lake, run_id: str) -> Table:
    """One row per sealed step: kept, drops by reason, and the three reward curves."""
    metrics = lake.read("step_metrics", filter=pc.field("run_id") == run_id).to_pylist()
    by_step: dict[int, dict[str, float]] = {}
    for row in metrics:
        by_step.setdefault(row["step"], {})[row["key"]] = row["value"]
    reasons = sorted({k[len(DROP_PREFIX):] for m in by_step.values() for k in m
                      if k.startswith(DROP_PREFIX)})
    table = Table(title=f"run {run_id}: sealed steps (dropped groups by reason)")
    for column in ["step", "kept", *[_label(r) for r in reasons], "surplus",
                   "cancelled", "raw_reward", "raw_reward\nunfiltered", "episode\nraw_reward"]:
        table.add_column(column, justify="right")

    def num(m: dict[str, float], key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(m[key]) if key in m else "-"

    for step in sorted(by_step):
        m = by_step[step]
        table.add_row(
            str(step), num(m, "rollout/groups_kept"),
            *[num(m, DROP_PREFIX + r) for r in reasons],
            num(m, "rollout/groups_surplus"), num(m, "rollout/groups_cancelled"),
            num(m, "rollout/raw_reward", "{:.3f}"),
            num(m, "rollout/raw_reward_unfiltered", "{:.3f}"),
            num(m, "rollout/episode_raw_reward", "{:.3f}"),
        )
    return table
