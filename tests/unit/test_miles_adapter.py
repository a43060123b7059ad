"""Miles `Sample` objects map to contract events (ingest/sdk/miles.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ingest.sdk.miles import miles_group_events, miles_run_config
from schemas.errors import EventValidationError
from tests.support.miles_samples import Sample, miles_sample

RUN = "miles-run"
Status = Sample.Status


def _events(samples, step=3):
    return miles_group_events(RUN, samples, step=step, producer_id="miles")


def test_a_group_is_its_group_started_then_one_event_per_sample():
    samples = [
        miles_sample(5, 40, prompt_tokens=[1, 2], response_tokens=[7, 8, 9], reward=1.0, response="abc",
                     weight_versions=["3", "2"], metadata={"source": "gsm8k"}),
        miles_sample(5, 41, prompt_tokens=[1, 2], response_tokens=[4], reward=0.0,
                     status=Status.TRUNCATED),
    ]
    samples[0].prompt, samples[0].label = "2+2=", "4"
    started, first, second = _events(samples)
    assert (started.type, started.group_index, started.step, started.n_samples,
            started.prompt, started.label, started.producer) == (
        "group_started", 5, 3, 2, "2+2=", "4", "miles")
    assert (first.type, first.rollout_id, first.sample_index, first.status) == (
        "sample_finished", 0, 40, "completed")
    assert first.prompt_tokens.tolist() == [1, 2]
    assert first.response_tokens.tolist() == [7, 8, 9]
    assert first.rollout_log_probs.tolist() == [-0.25] * 3
    assert (first.reward, first.response_text, first.weight_version, first.metadata) == (
        1.0, "abc", 2, {"source": "gsm8k"})
    assert (second.rollout_id, second.status, second.reward, second.response_text) == (
        1, "truncated", 0.0, None)


def test_aborted_and_failed_samples_are_sample_aborted_with_their_partial_tokens():
    samples = [miles_sample(0, 0, prompt_tokens=[1], response_tokens=[5, 6], status=Status.ABORTED),
               miles_sample(0, 1, prompt_tokens=[1], response_tokens=[], status=Status.FAILED)]
    _, aborted, failed = _events(samples)
    assert (aborted.type, aborted.reason, aborted.response_tokens.tolist()) == (
        "sample_aborted", "aborted", [5, 6])
    assert (failed.type, failed.reason, failed.response_tokens) == (
        "sample_aborted", "failed", None)


def test_a_string_status_works_like_the_enum():
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2], status="truncated",
                                          reward=1.0)])
    assert finished.status == "truncated"


def test_a_dict_reward_is_sent_whole_and_the_reward_key_goes_in_the_run_config():
    args = SimpleNamespace(n_samples_per_prompt=2, rollout_batch_size=4,
                           over_sampling_batch_size=None, reward_key="score",
                           dynamic_sampling_filter_path=None, lr=1e-6)
    assert miles_run_config(args) == {"n_samples_per_prompt": 2, "rollout_batch_size": 4,
                                      "reward_key": "score"}
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2],
                                          reward={"score": 0.5, "format": 1})])
    assert finished.reward == {"score": 0.5, "format": 1}


def test_an_unscored_sample_carries_an_explicit_null_reward():
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2], reward=None)])
    assert finished.has_reward and finished.reward is None


def test_a_numpy_reward_becomes_a_plain_float():
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2],
                                          reward=np.float32(0.5))])
    assert type(finished.reward) is float and finished.reward == 0.5


def test_missing_log_probs_and_mask_are_left_out():
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2, 3], reward=1.0,
                                          rollout_log_probs=None)])
    assert finished.rollout_log_probs is None and finished.loss_mask is None
    assert "rollout_log_probs" not in finished.model_fields_set


def test_a_removed_sample_is_sent_with_a_zero_loss_mask():
    (_, finished) = _events([miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2, 3], reward=1.0,
                                          loss_mask=[1, 1], remove_sample=True)])
    assert finished.loss_mask.tolist() == [0, 0]


def test_an_explicit_rollout_id_is_kept():
    sample = miles_sample(0, 0, prompt_tokens=[1], response_tokens=[2], reward=1.0)
    sample.rollout_id = 7
    (_, finished) = _events([sample])
    assert finished.rollout_id == 7


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: setattr(s[1], "status", Status.PENDING), "sample 1 of group 0: status 'pending'"),
    (lambda s: setattr(s[1], "group_index", 9), "group_index 9 is not the group's 0"),
    (lambda s: setattr(s[1], "response_length", 5), "response_length 5 is not within its 2"),
    (lambda s: setattr(s[1], "rollout_log_probs", [-1.0, -1.0]),
     "sample 1 of group 0: sample_finished event .*rollout_log_probs has 2 entries"),
    (lambda s: setattr(s[1], "weight_versions", ["v1"]), "weight_versions \\['v1'\\]"),
])
def test_a_bad_sample_is_one_error_naming_it(change, message):
    samples = [miles_sample(0, i, prompt_tokens=[1], response_tokens=[2], reward=1.0) for i in range(2)]
    change(samples)
    with pytest.raises(EventValidationError, match=message):
        _events(samples)


def test_an_empty_group_is_refused():
    with pytest.raises(EventValidationError, match="at least one sample"):
        _events([])
