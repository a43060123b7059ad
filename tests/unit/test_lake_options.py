"""Storage options of a lake: one place turns the environment and flags into delta-rs
options, with safe (conditional-put) commits on S3."""

from __future__ import annotations

import pytest

from ingest.io.lake import Lake
from ingest.io.lake_location import lake_storage_options
from schemas.errors import ConfigError

ENV = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
    "HOME": "/root",  # not an object-store setting
}


S3_OPTIONS = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
    "AWS_CONDITIONAL_PUT": "etag",
}


def test_s3_lake_takes_aws_environment_and_commits_with_conditional_put():
    assert lake_storage_options("s3://bucket/lake", environ=ENV) == S3_OPTIONS


def test_explicit_options_win_over_the_environment():
    options = lake_storage_options(
        "s3://bucket/lake", {"AWS_REGION": "eu-west-1", "aws_conditional_put": "etag"}, ENV
    )
    assert options["AWS_REGION"] == "eu-west-1"
    assert options["aws_conditional_put"] == "etag"
    assert "AWS_CONDITIONAL_PUT" not in options  # one spelling, the caller's


def test_local_lake_ignores_the_environment():
    assert lake_storage_options("/data/lake", environ=ENV) == {}


@pytest.mark.parametrize("name", ["AWS_S3_ALLOW_UNSAFE_RENAME", "aws_s3_allow_unsafe_rename"])
def test_unsafe_rename_is_refused_with_one_line(name):
    with pytest.raises(ConfigError) as raised:
        lake_storage_options("s3://bucket/lake", {name: "true"}, ENV)
    assert str(raised.value).startswith("AWS_S3_ALLOW_UNSAFE_RENAME is set:")
    with pytest.raises(ConfigError):
        lake_storage_options("s3://bucket/lake", environ={**ENV, "AWS_S3_ALLOW_UNSAFE_RENAME": "1"})


def test_lake_uses_those_options(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    lake = Lake("s3://bucket/lake")
    assert lake.storage_options == S3_OPTIONS
