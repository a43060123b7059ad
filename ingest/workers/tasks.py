"""Small verifiable tasks a random tiny policy learns by RL alone: dataset rows and reward.

`repeat_digit`: the prompt is one digit, the reward is the share of the response's
characters that are that digit (an empty response scores 0). The tiny policy's 64-token
vocabulary makes a random policy score about 1/64; a policy that answers only the digit
scores 1. Rewards have the Miles `--custom-rm-path` signature.
"""

from __future__ import annotations

from typing import Any

DIGITS = "0123456789"


def repeat_digit_rows() -> list[dict[str, str]]:
    """One dataset row per digit, labelled with itself."""
    return [{"input": digit, "label": digit} for digit in DIGITS]


async def repeat_digit(args: Any, sample: Any) -> float:
    """Share of the response's characters that equal the prompt's digit (the label)."""
    response = sample.response
    return sum(ch == sample.label for ch in response) / len(response) if response else 0.0
