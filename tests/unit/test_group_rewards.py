"""`--group-rm`: Miles' batched reward form `rm(args, samples) -> list` scores a group at once."""

from __future__ import annotations

import asyncio

import pytest

from ingest.core.filters import SampleStatus
from ingest.workers.rewards import RewardSample, score_group


def group(*responses: str) -> list[RewardSample]:
    return [RewardSample(group_index=4, index=8 + i, rollout_id=i,
                         status=SampleStatus.COMPLETED, label="7", response=r)
            for i, r in enumerate(responses)]


async def share_of_label(args, samples):
    """Rewards relative to the group: 1 for the responses holding the label most often."""
    counts = [s.response.count(s.label) for s in samples]
    return [float(c == max(counts)) for c in counts]


def test_the_function_sees_the_whole_group_and_each_sample_gets_its_reward():
    assert asyncio.run(score_group(share_of_label, None, group("77", "7", "x"))) == [
        1.0, 0.0, 0.0]


def test_a_plain_function_and_dict_rewards_work():
    def by_length(args, samples):
        return [{"score": len(s.response)} for s in samples]
    assert asyncio.run(score_group(by_length, None, group("ab", ""))) == [
        {"score": 2}, {"score": 0}]


def test_a_function_that_raises_scores_the_whole_group_null(caplog):
    async def broken(args, samples):
        raise KeyError("judge")
    assert asyncio.run(score_group(broken, None, group("a", "b", "c"))) == [None] * 3
    assert "group reward function raised KeyError: 'judge' (group 4); rewards null" \
        in caplog.text


@pytest.mark.parametrize(("result", "said"), [
    ([1.0], "returned 1 rewards for 2 samples"),
    ([1.0, 0.0, 1.0], "returned 3 rewards for 2 samples"),
    (0.5, "returned float for 2 samples"),
    (None, "returned NoneType for 2 samples"),
])
def test_a_result_of_another_length_scores_the_whole_group_null(result, said, caplog):
    async def wrong(args, samples):
        return result
    assert asyncio.run(score_group(wrong, None, group("a", "b"))) == [None, None]
    assert said in caplog.text


def test_each_reward_is_checked_like_a_single_one():
    async def mixed(args, samples):
        return [float("nan"), 1, "high"]
    assert asyncio.run(score_group(mixed, None, group("a", "b", "c"))) == [None, 1.0, None]


def test_an_empty_group_is_not_scored():
    async def never(args, samples):
        raise AssertionError("called")
    assert asyncio.run(score_group(never, None, [])) == []
