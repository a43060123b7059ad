"""Without the `spark` extra, a Spark session is a one-line error naming the fix."""

from __future__ import annotations

import sys

import pytest

from ingest.io.spark import spark_session
from schemas.errors import ConfigError


def test_a_missing_delta_spark_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "delta", None)  # import delta fails as if not installed
    with pytest.raises(ConfigError) as failed:
        spark_session()
    assert str(failed.value).startswith("Spark needs pyspark and delta-spark (")
    assert str(failed.value).endswith("): pip install 'rolloutlake[spark]'")
    assert "\n" not in str(failed.value)
