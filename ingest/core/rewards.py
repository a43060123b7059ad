"""Reading a raw reward (number, bool, object or null) the one way filters and metrics share.

A reward keeps its JSON type on the wire (int 0 and float 0.0 give different DAPO drop
reasons), so this module never converts eagerly: `reward_value` returns the value as sent,
`numeric_reward` converts it to float only for arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

# Numbers as the contract allows them; bool is an int subclass and counts as numeric (Miles too).
NUMERIC_TYPES = (int, float)


def reward_value(reward: Any, reward_key: str | None) -> Any:
    """Miles `Sample.get_reward_value`: the reward itself, or `reward[reward_key]`.

    Like Miles, a dict that lacks `reward_key` raises KeyError. Unlike Miles, a plain
    number with a `reward_key` configured is returned as is instead of failing with
    TypeError: CONTRACT section 2 reads only objects through `reward_key`.
    """
    if reward_key and isinstance(reward, dict):
        return reward[reward_key]
    return reward


def is_missing_reward(reward: Any, reward_key: str | None) -> bool:
    """CONTRACT section 3 step 2: null, an object without `reward_key`, or a null value.

    A dict reward with no `reward_key` configured, or lacking the key, is missing here; in
    Miles it raises KeyError (MILES_SEMANTICS quirk 8). The contract decides.
    """
    if reward is None:
        return True
    if isinstance(reward, dict):
        return not reward_key or reward_key not in reward or reward[reward_key] is None
    return False


def is_numeric(value: Any) -> bool:
    return isinstance(value, NUMERIC_TYPES)


def numeric_reward(reward: Any, reward_key: str | None) -> float | None:
    """The reward as float64 for arithmetic, or None when it has no numeric value.

    bool -> 0.0/1.0; int/float -> float; dict -> its `reward_key` entry read the same way
    (None when no key is configured, the key is absent, or the entry is not a number);
    None and any other type -> None. NaN passes through as NaN (JSON cannot carry it).
    """
    if isinstance(reward, dict):
        if not reward_key or reward_key not in reward:
            return None
        reward = reward[reward_key]
    if isinstance(reward, NUMERIC_TYPES):
        return float(reward)
    return None


def rewards_equal(a: float, b: float) -> bool:
    """Exact equality, where NaN equals NaN (so one NaN reward is not a 'conflict')."""
    return a == b or (math.isnan(a) and math.isnan(b))
