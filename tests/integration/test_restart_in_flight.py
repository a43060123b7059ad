"""Restarts with groups in flight: the processor resumes them from the archive."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.pipeline import by_group, event, publish, rows, sample

CONFIG = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}


def process(kafka, lake_root: str, until_idle: float = 3.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
         kafka.bootstrap_servers, "--lake", lake_root, "--topic-prefix", kafka.topic_prefix,
         "--until-idle", str(until_idle), "--consumer-group", "restart"],
        capture_output=True, text=True, timeout=180, env=dict(os.environ),
    )


def test_restart_with_a_group_in_flight_resumes_it(kafka, lake_root):
    run = "inflight"
    publish(kafka, run, CONFIG, [
        event("group_started", run, group_index=0, step=0, n_samples=2),
        sample(run, 0, 0, 1.0),
    ])
    first = process(kafka, lake_root)
    assert first.returncode == 0, first.stderr[-3000:]
    assert by_group(lake_root, run) == {}

    second = process(kafka, lake_root)  # the group is rebuilt from the archive, still open
    assert second.returncode == 0, second.stderr[-3000:]
    assert by_group(lake_root, run) == {}

    publish(kafka, run, None, [sample(run, 0, 1, 0.0)])
    third = process(kafka, lake_root)
    assert third.returncode == 0, third.stderr[-3000:]
    decided = rows(lake_root, "groups", run)
    assert [(g["group_index"], g["decision"], g["batch_step"]) for g in decided] == [(0, "kept", 0)]
    assert len(rows(lake_root, "samples", run)) == 2
    assert [s["step"] for s in rows(lake_root, "steps", run)] == [0]
