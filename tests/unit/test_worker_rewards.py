"""How the worker turns a Miles reward function's result into the event's reward."""

from __future__ import annotations

import asyncio

import pytest

from ingest.core.filters import SampleStatus
from ingest.workers.rewards import RewardSample, checked_reward, score


def sample(response: str = "42") -> RewardSample:
    return RewardSample(group_index=3, index=6, rollout_id=0, status=SampleStatus.COMPLETED,
                        prompt="40+2=", label="42", response=response)


async def exact(args, s):
    return float(s.response == s.label)


async def broken(args, s):
    raise ZeroDivisionError("division by zero")


def sync_length(args, s):
    return len(s.response)


def test_async_reward_function_sees_response_and_label():
    assert asyncio.run(score(exact, None, sample("42"))) == 1.0
    assert asyncio.run(score(exact, None, sample("41"))) == 0.0


def test_raising_reward_function_scores_null_and_says_so(caplog):
    assert asyncio.run(score(broken, None, sample())) is None
    assert "reward function raised ZeroDivisionError: division by zero (group 3 rollout 0)" \
        in caplog.text


def test_plain_function_is_accepted_and_ints_become_floats():
    result = asyncio.run(score(sync_length, None, sample("abc")))
    assert result == 3.0 and isinstance(result, float)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "0.5", [1.0]])
def test_results_the_contract_cannot_carry_become_null(value):
    assert checked_reward(value) is None


def test_dict_rewards_pass_through_for_reward_key():
    assert checked_reward({"score": 0.5, "acc": 1}) == {"score": 0.5, "acc": 1}
