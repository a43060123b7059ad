"""The diff of a replay or what-if: a run in its original lake against the same run
re-derived into another lake (`replay --into`), as data, a terminal table, JSON and a PNG
of the curves; `replay --check` is this diff being empty.

Groups whose decision, reason, batch step or other decided columns changed (with why),
steps whose content hash changed or that exist on one side only, and every step metric
with its delta.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from ingest.io.lake import Lake
from ingest.io.plots import Curve, Panel, save_panels
from schemas.errors import RolloutlakeError

# Shown in the terminal (all keys are in the JSON); also the default curves of the PNG.
HEADLINE_METRICS = ("rollout/raw_reward", "rollout/raw_reward_unfiltered",
                    "rollout/num_training_samples", "rollout/groups_kept")


@dataclass(frozen=True)
class Decision:
    """A group's row in `groups`: every column a re-derivation must reproduce."""

    decision: str
    reason: str | None
    batch_step: int | None
    step: int | None
    n_fragments: int
    mean_reward: float | None
    ordered_at: object  # timestamp

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        step = f" into step {self.batch_step}" if self.batch_step is not None else ""
        return f"{self.decision}{reason}{step}"


@dataclass(frozen=True)
class GroupChange:
    group_index: int
    original: Decision | None  # None: not decided in that lake
    what_if: Decision | None
    why: str


@dataclass(frozen=True)
class StepChange:
    step: int
    original_sha256: str | None  # None: not sealed in that lake
    what_if_sha256: str | None
    original_rows: int | None
    what_if_rows: int | None


@dataclass(frozen=True)
class MetricDelta:
    original: float | None
    what_if: float | None

    @property
    def delta(self) -> float | None:
        if self.original is None or self.what_if is None:
            return None
        return self.what_if - self.original


@dataclass
class WhatIfDiff:
    run_id: str
    groups_compared: int
    groups: list[GroupChange]
    steps_compared: int
    steps: list[StepChange]
    metrics: dict[int, dict[str, MetricDelta]]  # step -> key -> values; every step and key

    def differences(self) -> dict[str, list]:
        """What differs, per table (`groups`: group indices, `steps`: steps,
        `step_metrics`: (step, key)); empty when the re-derivation equals the original."""
        metrics = [(step, key) for step, keys in self.metrics.items()
                   for key, m in keys.items() if m.original != m.what_if]
        found: dict[str, list[Any]] = {"steps": [s.step for s in self.steps],
                                       "groups": [g.group_index for g in self.groups],
                                       "step_metrics": metrics}
        return {table: keys for table, keys in found.items() if keys}

    def to_json(self) -> bytes:
        body = dataclasses.asdict(self)
        for step, keys in self.metrics.items():
            for key, values in keys.items():
                body["metrics"][step][key]["delta"] = values.delta
        return orjson.dumps(body, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)


def _why(before: Decision | None, after: Decision | None) -> str:
    if before is None or after is None:
        side = "original" if before is None else "what-if"
        return f"not decided in the {side} lake (its events end before a decision)"
    if before.decision != after.decision:
        if after.decision == "dropped":
            return f"the what-if filter drops it: {after.reason}"
        if before.decision == "dropped":
            return f"the what-if keeps what the original dropped for {before.reason}"
        if after.decision == "surplus":
            return "surplus under the what-if: its step was already full"
        return f"{before.decision} -> {after.decision}: room in step {after.batch_step}"
    if before.reason != after.reason:
        return f"same decision, reason {before.reason} -> {after.reason}"
    if before.batch_step != after.batch_step:
        return f"batched into step {after.batch_step} instead of {before.batch_step}"
    changed = [f.name for f in dataclasses.fields(Decision)
               if getattr(before, f.name) != getattr(after, f.name)]
    return f"same decision, {', '.join(changed)} differ"


def _decisions(lake: Lake, run_id: str) -> dict[int, Decision]:
    columns = ["group_index", *(f.name for f in dataclasses.fields(Decision))]
    rows = lake.read("groups", filter=pc.field("run_id") == run_id, columns=columns).to_pylist()
    return {r.pop("group_index"): Decision(**r) for r in rows}


def _steps(lake: Lake, run_id: str) -> dict[int, tuple[str, int]]:
    rows = lake.read("steps", filter=pc.field("run_id") == run_id,
                     columns=["step", "content_sha256", "n_samples"]).to_pylist()
    return {r["step"]: (r["content_sha256"], r["n_samples"]) for r in rows}


def _metrics(lake: Lake, run_id: str) -> dict[int, dict[str, float]]:
    rows = lake.read("step_metrics", filter=pc.field("run_id") == run_id,
                     columns=["step", "key", "value"]).to_pylist()
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["step"], {})[r["key"]] = r["value"]
    return out


def compare_lakes(original: Lake, what_if: Lake, run_id: str) -> WhatIfDiff:
    """The what-if lake's run against the original's; RolloutlakeError if the what-if lake
    holds nothing of the run."""
    before, after = _decisions(original, run_id), _decisions(what_if, run_id)
    if not after:
        raise RolloutlakeError(f"what-if lake {what_if.root} has no groups of run {run_id!r} "
                               "(replay the run into it first)")
    groups = [GroupChange(g, before.get(g), after.get(g), _why(before.get(g), after.get(g)))
              for g in sorted(before.keys() | after.keys()) if before.get(g) != after.get(g)]
    sealed_before, sealed_after = _steps(original, run_id), _steps(what_if, run_id)
    steps = []
    for step in sorted(sealed_before.keys() | sealed_after.keys()):
        b, a = sealed_before.get(step), sealed_after.get(step)
        if b is None or a is None or b[0] != a[0]:
            steps.append(StepChange(step, b and b[0], a and a[0], b and b[1], a and a[1]))
    metrics_before, metrics_after = _metrics(original, run_id), _metrics(what_if, run_id)
    metrics = {
        step: {key: MetricDelta(metrics_before.get(step, {}).get(key),
                                metrics_after.get(step, {}).get(key))
               for key in sorted(metrics_before.get(step, {}).keys()
                                 | metrics_after.get(step, {}).keys())}
        for step in sorted(metrics_before.keys() | metrics_after.keys())}
    return WhatIfDiff(run_id, len(before.keys() | after.keys()), groups,
                      len(sealed_before.keys() | sealed_after.keys()), steps, metrics)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _ranges(steps: list[int]) -> str:
    """Sorted steps as `0-3, 7`."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def print_diff(diff: WhatIfDiff, console: Console, *, what: str = "what-if",
               max_groups: int = 50) -> None:
    """`what` names the re-derivation in the first line: "what-if" or "replay"."""
    console.print(f"{what} of run {diff.run_id}: {len(diff.groups)} of "
                  f"{diff.groups_compared} groups changed decision, {len(diff.steps)} of "
                  f"{diff.steps_compared} steps changed content")
    if diff.groups:
        table = Table(title="groups whose decision changed")
        for column in ("group", "original", "what-if", "why"):
            table.add_column(column)
        for g in diff.groups[:max_groups]:
            table.add_row(str(g.group_index), str(g.original or "-"), str(g.what_if or "-"),
                          g.why)
        console.print(table)
        if len(diff.groups) > max_groups:
            console.print(f"... and {len(diff.groups) - max_groups} more (--json has all)")
    for side, missing in (("original", "what_if_sha256"), ("what-if", "original_sha256")):
        only = [s.step for s in diff.steps if getattr(s, missing) is None]
        if only:
            console.print(f"steps sealed only in the {side}: {_ranges(only)} (a batch size "
                          "changes how many steps the same events fill)")
    if diff.steps:
        table = Table(title="steps whose content changed")
        for column in ("step", "original rows", "what-if rows", "original sha256",
                       "what-if sha256"):
            table.add_column(column)
        for s in diff.steps:
            table.add_row(str(s.step), _number(s.original_rows), _number(s.what_if_rows),
                          (s.original_sha256 or "not sealed")[:12],
                          (s.what_if_sha256 or "not sealed")[:12])
        console.print(table)
    table = Table(title="metrics per step: original -> what-if (delta)")
    table.add_column("step")
    for key in HEADLINE_METRICS:
        table.add_column(key.removeprefix("rollout/"))
    for step, keys in diff.metrics.items():
        cells = []
        for key in HEADLINE_METRICS:
            m = keys.get(key, MetricDelta(None, None))
            delta = "" if m.delta is None else f" ({m.delta:+.4g})"
            cells.append(f"{_number(m.original)} -> {_number(m.what_if)}{delta}")
        table.add_row(str(step), *cells)
    console.print(table)


def plot_diff(diff: WhatIfDiff, path: Path, keys: tuple[str, ...] = HEADLINE_METRICS,
              *, title: str | None = None) -> Path:
    """A PNG with one panel per metric key (left to right, two a row, in `keys` order): the
    original's curve over steps and the what-if's, each panel on its own scale."""
    panels = []
    for key in keys:
        curves = []
        for side, label, style in (("original", "original", "-"),
                                   ("what_if", "what-if", "--")):
            points = [(step, getattr(m[key], side)) for step, m in diff.metrics.items()
                      if key in m and getattr(m[key], side) is not None]
            curves.append(Curve(label, [s for s, _ in points], [v for _, v in points],
                                linestyle=style, marker="."))
        panels.append(Panel(key, key.removeprefix("rollout/"), curves))
    return save_panels(path, panels, columns=2, panel_size=(6, 3.5),
                       title=title or f"run {diff.run_id}: original vs what-if")
