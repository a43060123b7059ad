"""Scoring with Miles reward functions: one sample (`--custom-rm-path`) or a whole group
(`--group-rm`). A function that raises, or answers what the contract cannot carry, scores
null (scoring failed, so the processor drops the group `group_has_missing_reward`); the
worker never stops for it.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.core.filters import MilesSample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RewardSample(MilesSample):
    """What a Miles `--custom-rm-path` function gets: the sample plus its decoded response."""

    response: str = ""


def checked_reward(value: Any) -> Any:
    """A reward the contract can carry: a finite number, an object, or null."""
    if isinstance(value, bool) or not isinstance(value, int | float | dict | type(None)):
        log.warning("reward function returned %s, not a number or dict; reward null",
                    type(value).__name__)
        return None
    if isinstance(value, float) and not math.isfinite(value):
        log.warning("reward function returned %r; reward null", value)
        return None
    return float(value) if isinstance(value, int) else value


async def score(reward_fn: Callable[..., Any], args: Any, sample: RewardSample) -> Any:
    """The sample's reward; a reward function that raises scores it null (scoring failed)."""
    try:
        result = reward_fn(args, sample)
        if inspect.isawaitable(result):
            result = await result
    except Exception as err:  # the user's function: any failure is a missing reward
        log.warning("reward function raised %s: %s (group %d rollout %d); reward null",
                    type(err).__name__, err, sample.group_index, sample.rollout_id)
        return None
    return checked_reward(result)


async def score_group(reward_fn: Callable[..., Any], args: Any,
                      samples: Sequence[RewardSample]) -> list[Any]:
    """One reward per sample from Miles' batched form `rm(args, samples) -> list`; a
    function that raises or returns another number of rewards scores the group null."""
    if not samples:
        return []
    where = f"group {samples[0].group_index}"
    try:
        result = reward_fn(args, list(samples))
        if inspect.isawaitable(result):
            result = await result
    except Exception as err:  # the user's function: any failure is a missing reward
        log.warning("group reward function raised %s: %s (%s); rewards null",
                    type(err).__name__, err, where)
        return [None] * len(samples)
    if not isinstance(result, list | tuple) or len(result) != len(samples):
        got = f"{len(result)} rewards" if isinstance(result, list | tuple) else \
            type(result).__name__
        log.warning("group reward function returned %s for %d samples (%s); rewards null",
                    got, len(samples), where)
        return [None] * len(samples)
    return [checked_reward(value) for value in result]
