"""Reward functions with the Miles `--custom-rm-path` signature, for the worker tests."""

from __future__ import annotations


async def digit_share_or_raise(args, sample):
    """Share of digits in the response; raises for rows labelled "boom" (a broken scorer)."""
    if sample.label == "boom":
        raise RuntimeError("the scorer crashed")
    return sum(ch.isdigit() for ch in sample.response) / max(len(sample.response), 1)


async def spread_only_every_third_group(args, sample):
    """1 for rollout 0 of groups whose index divides by 3, else 0: every other group has
    zero reward std, so the DAPO filter drops two groups of three."""
    return float(sample.group_index % 3 == 0 and sample.rollout_id == 0)


async def group_digit_share_or_fail(args, samples):
    """`--group-rm` form of `digit_share_or_raise`: raises for a group labelled "boom" and
    answers one reward too few for a group labelled "short"."""
    label = samples[0].label
    if label == "boom":
        raise RuntimeError("the group scorer crashed")
    rewards = [sum(ch.isdigit() for ch in s.response) / max(len(s.response), 1)
               for s in samples]
    return rewards[:-1] if label == "short" else rewards
