"""A Spark session that reads and writes the lake's Delta tables (delta-spark).

pyspark and delta-spark are the `spark` extra (`pip install 'rolloutlake[spark]'`); the
Delta jars come through Spark's package resolution (Maven Central, cached in Ivy's
default folder). Used by `rolloutlake replay --engine spark` and `bench/spark_metrics.py`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from schemas.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def spark_session(master: str = "local[2]", driver_memory: str = "1g",
                  shuffle_partitions: int = 2) -> SparkSession:
    """A Spark session on `master` that reads and writes Delta; ConfigError when pyspark or
    delta-spark is not installed."""
    try:
        from delta import configure_spark_with_delta_pip
        from pyspark.sql import SparkSession
    except ModuleNotFoundError as err:
        raise ConfigError(f"Spark needs pyspark and delta-spark ({err}): "
                          "pip install 'rolloutlake[spark]'") from None

    builder = (
        SparkSession.builder.master(master)
        .appName("rolloutlake-spark")
        .config("spark.sql.extensions", DELTA_EXTENSION)
        .config("spark.sql.catalog.spark_catalog", DELTA_CATALOG)
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        # Delta replays its log into 50 partitions by default: pure overhead on one machine.
        .config("spark.databricks.delta.snapshotPartitions", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        # Parquet timestamps as the lake's other writers store them (Spark's default is
        # INT96, which delta-rs readers must convert).
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # A busy machine (CI, shared cores) delays heartbeats past the 10 s default; the
        # driver then drops its own executor and the session logs errors it cannot act on.
        .config("spark.executor.heartbeatInterval", "60s")
        .config("spark.network.timeout", "600s")
    )
    if master.startswith("local"):
        # Python UDFs run in worker processes that pyspark starts from PYSPARK_PYTHON, else
        # `python3` on PATH; locally, the interpreter that has rolloutlake is this one.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = configure_spark_with_delta_pip(builder).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
