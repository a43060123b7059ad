"""What-if `--config KEY=VALUE` parsing."""

from __future__ import annotations

import pytest

from ingest.core.whatif import parse_what_if
from schemas.errors import ConfigError, FilterLoadError
from schemas.events import DAPO_FILTER_PATH, RunConfig

ORIGINAL = RunConfig(n_samples_per_prompt=4, rollout_batch_size=2, over_sampling_batch_size=3,
                     dynamic_sampling_filter_path=DAPO_FILTER_PATH, reward_key="score")


def test_every_key_parses_to_its_config_field():
    what_if = parse_what_if([
        "filter=none", "rollout_batch_size=6", "over_sampling_batch_size=8",
        "advantage_estimator=gspo", "std_normalization=false", "reward_key=none",
        "max_staleness=1", "arg.max_len=100", "arg.tag=blue"])
    config = what_if.apply(ORIGINAL)
    assert config.dynamic_sampling_filter_path is None
    assert (config.rollout_batch_size, config.over_sampling_batch_size) == (6, 8)
    assert config.advantage_estimator == "gspo" and config.std_normalization is False
    assert config.reward_key is None and config.max_staleness == 1
    assert config.extra_args == {"max_len": 100, "tag": "blue"}
    assert config.n_samples_per_prompt == 4  # not a what-if key: kept from the run


def test_filter_names_the_builtin_or_a_user_filter():
    assert parse_what_if(["filter=dapo"]).overrides == {
        "dynamic_sampling_filter_path": DAPO_FILTER_PATH}
    user = "tests.support.user_filters.drop_long"
    assert parse_what_if([f"filter={user}"]).apply(ORIGINAL).resolved_filter_path == user
    with pytest.raises(FilterLoadError, match="no.such"):
        parse_what_if(["filter=no.such.fn"])


@pytest.mark.parametrize(("items", "message"), [
    (["batch=3"], "--config 'batch=3': unknown key 'batch' (keys: filter, rollout_batch_size,"),
    (["rollout_batch_size"], "--config 'rollout_batch_size': expected KEY=VALUE"),
    (["rollout_batch_size=0"], "--config 'rollout_batch_size=0': rollout_batch_size must be >= 1"),
    (["max_staleness=soon"], "--config 'max_staleness=soon': max_staleness not an integer"),
    (["advantage_estimator=ppo"], "advantage_estimator must be one of grpo, gspo, "
                                  "reinforce_plus_plus_baseline, none"),
    (["std_normalization=maybe"], "std_normalization must be true or false"),
    (["max_staleness=1", "max_staleness=2"], "max_staleness is given twice"),
    (["arg.reward_key=x"], "reward_key is a config field; pass reward_key=VALUE"),
])
def test_bad_items_are_one_line_errors(items, message):
    with pytest.raises(ConfigError) as err:
        parse_what_if(items)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_contradiction_with_the_run_names_the_fix():
    with pytest.raises(ConfigError) as err:
        parse_what_if(["rollout_batch_size=6"]).apply(ORIGINAL)
    assert "over_sampling_batch_size (3) must be >= rollout_batch_size (6)" in str(err.value)
    assert "\n" not in str(err.value)
