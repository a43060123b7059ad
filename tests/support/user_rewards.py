"""Reward functions with the Miles `--custom-rm-path` signature, for the worker tests."""

from __future__ import annotations


async def digit_share_or_raise(args, sample):
    """Share of digits in the response; raises for rows labelled "boom" (a broken scorer)."""
    if sample.label == "boom":
        raise RuntimeError("the scorer crashed")
    return sum(ch.isdigit() for ch in sample.response) / max(len(sample.response), 1)
