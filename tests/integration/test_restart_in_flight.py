"""Restarts with groups in flight: the processor resumes them from the archive."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from tests.integration.pipeline import by_group, event, publish, rows, run_processor, sample

CONFIG = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}


def process(kafka, lake_root: str, until_idle: float = 3.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
         kafka.bootstrap_servers, "--lake", lake_root, "--topic-prefix", kafka.topic_prefix,
         "--until-idle", str(until_idle), "--consumer-group", f"{kafka.topic_prefix}restart"],
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
    # The rebuilt group's notices are sent again; the batch stage knows them already.
    assert "came after later ones" not in second.stderr + third.stderr
    decided = rows(lake_root, "groups", run)
    assert [(g["group_index"], g["decision"], g["batch_step"]) for g in decided] == [
        (0, "kept", 0)], third.stderr[-3000:]
    assert len(rows(lake_root, "samples", run)) == 2
    assert [s["step"] for s in rows(lake_root, "steps", run)] == [0]


def test_late_duplicate_of_a_group_decided_before_a_restart_is_dropped(kafka, lake_root):
    run = "latedup"
    finished = sample(run, 0, 1, 0.0)
    publish(kafka, run, CONFIG, [
        event("group_started", run, group_index=0, step=0, n_samples=2),
        sample(run, 0, 0, 1.0), finished,
    ])
    run_processor(kafka, lake_root, idle_s=1.0)
    assert by_group(lake_root, run)[0]["decision"] == "kept"

    publish(kafka, run, None, [finished])  # redelivered after the processor restarted
    run_processor(kafka, lake_root, idle_s=1.0)
    assert rows(lake_root, "dead_letters") == []
    assert len(rows(lake_root, "events", run)) == 4  # run_started + 3, the duplicate not again


def test_out_of_range_fragment_before_the_last_one_is_dead_lettered(kafka, lake_root):
    run = "stray"
    stray = event("compaction_fragment", run, group_index=0, rollout_id=0, fragment_index=7,
                  prompt_tokens=[1], response_tokens=[9])
    publish(kafka, run, CONFIG, [
        event("group_started", run, group_index=0, step=0, n_samples=2),
        stray,
        event("compaction_fragment", run, group_index=0, rollout_id=0, fragment_index=0,
              prompt_tokens=[1], response_tokens=[5, 6]),
        sample(run, 0, 0, 1.0, fragment_count=2),
        sample(run, 0, 1, 0.0),
    ])
    run_processor(kafka, lake_root, idle_s=1.0)
    group = by_group(lake_root, run)[0]
    assert (group["decision"], group["reason"], group["n_fragments"]) == ("kept", None, 3)
    dead = rows(lake_root, "dead_letters")
    assert [(d["error"], d["group_index"]) for d in dead] == [
        ("fragment_index 7 is not below the rollout's fragment_count 2", 0)]
    assert orjson.loads(dead[0]["raw"])["event_id"] == stray["event_id"]
