"""Flags made from service configs (`schemas/config.py`), on the real service models."""

from __future__ import annotations

import argparse

import pytest

from gateway.config import GatewayConfig
from ingest.commands.simulate import SimulationConfig
from ingest.io.kafka import KafkaSettings
from ingest.processor.config import ProcessorConfig
from schemas.config import add_config_flags, build_config, config_from_args
from schemas.errors import ConfigError
from trainer.config import TrainerConfig


def parse(model, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, model)
    return parser.parse_args(argv)


def test_flags_not_given_leave_the_defaults():
    config = config_from_args(ProcessorConfig, parse(ProcessorConfig, "--lake", "lake"))
    assert config == ProcessorConfig(lake="lake")


def test_nested_kafka_flags_are_unprefixed_and_parsed_by_the_model():
    args = parse(ProcessorConfig, "--lake", "lake", "--bootstrap-servers", "k:9092",
                 "--event-partitions", "8", "--until-idle", "2.5", "--wandb")
    config = config_from_args(ProcessorConfig, args)
    assert config.kafka == KafkaSettings(bootstrap_servers="k:9092", event_partitions=8)
    assert config.until_idle_s == 2.5 and config.wandb is True


def test_none_unsets_a_field_whose_default_is_set():
    assert config_from_args(SimulationConfig, parse(SimulationConfig)).filter_path is not None
    for value in ("none", ""):
        args = parse(SimulationConfig, "--filter-path", value)
        assert config_from_args(SimulationConfig, args).filter_path is None


def test_an_optional_model_is_set_by_any_of_its_flags(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    required = ("--lake", "lake", "--run", "r1", "--deepspeed", str(ds))
    assert config_from_args(TrainerConfig, parse(TrainerConfig, *required)).kafka is None
    args = parse(TrainerConfig, *required, "--topic-prefix", "t.")
    assert config_from_args(TrainerConfig, args).kafka == KafkaSettings(topic_prefix="t.")


def test_lists_dicts_and_secrets_have_no_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, GatewayConfig)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {"--lake", "--tokens-file", "--bootstrap-servers"} <= flags
    assert not flags & {"--tokens", "--tokenizers", "--sasl-password", "--security-protocol"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--sasl-password", "x"])


def test_help_is_the_field_docstring_with_its_default():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ProcessorConfig)
    text = " ".join(parser.format_help().split())
    assert ("--snapshot-every N `rollout.decisions` records (decisions, notices, watermarks) "
            "between two snapshots") in text
    assert "a restart replays at most this many. [default: 500]" in text


@pytest.mark.parametrize(("values", "expected"), [
    ({"kafka": {"request_timeout_ms": 5}},
     "--request-timeout-ms: Input should be greater than or equal to 1000"),
    # A field without a flag (set in a config file) is named by its path.
    ({"tokens": [{"name": "ci", "sha256": "x", "scopes": ["read"]}]},
     "tokens.0.sha256: String should match pattern '^[0-9a-f]{64}$'"),
    ({"kafka": {"ssl_certfile": "/nonexistent.pem"}},
     "kafka ssl_certfile: no such file: /nonexistent.pem"),  # a check of the whole model
])
def test_errors_name_the_flag_or_the_path(values, expected):
    with pytest.raises(ConfigError) as info:
        build_config(GatewayConfig, {"allow_anonymous": True, **values})
    assert str(info.value) == expected


def test_wandb_mode_from_the_environment_is_validated(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    monkeypatch.setenv("WANDB_MODE", "onlin")
    with pytest.raises(ConfigError) as info:
        build_config(TrainerConfig, {"lake": "lake", "run_id": "r1", "deepspeed": str(ds)})
    assert str(info.value) == "--wandb-mode: Input should be 'offline', 'online' or 'disabled'"


def test_loop_flags_come_from_its_model():
    from ingest.commands.loop import LoopConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--steps", "3", "--zero-stage", "3"])
    assert config_from_args(LoopConfig, args) == LoopConfig(steps=3, zero_stage=3)
