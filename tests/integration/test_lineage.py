"""Lineage on a run the stream processor sealed and the real trainer trained: from a
`trainer_steps` row back to its events and forward again, time travel, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from ingest.io.lake import Lake
from ingest.io.lineage import (
    RAW_PREVIEW_CHARS,
    LineageNotFound,
    Snapshot,
    group_lineage,
    parse_as_of,
    row_lineage,
    trainer_step_lineage,
)
from schemas.errors import InvalidInputError
from tests.integration.pipeline import event, ordered_kafka, publish, run_processor, sample
from tests.integration.test_cli import cli, one_line_error

pytestmark = [pytest.mark.slow,
              pytest.mark.one_broker("tests lineage through the processor and the trainer")]

RUN = "lineage-run"
REPO = Path(__file__).resolve().parents[2]
CONFIG = {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
          "dynamic_sampling_filter_path": "ingest.core.filters.reward_nonzero_std"}
# group -> (step it is issued for, rewards of its two rollouts); group 2 has zero reward
# std, so the filter drops it and groups 3 and 4 make step 1.
PLAN = {0: (0, (1.0, 0.0)), 1: (0, (0.0, 1.0)), 2: (1, (1.0, 1.0)), 3: (1, (1.0, 0.0)),
        4: (1, (0.0, 1.0))}
TRAINED = {0: {0, 1}, 1: {3, 4}}  # trainer step -> groups it trains on


@pytest.fixture(scope="module")
def trained(broker, tmp_path_factory):
    """The lake, the event ids published per group, and the dead-lettered event's id."""
    root = tmp_path_factory.mktemp("lineage")
    kafka = ordered_kafka(broker.bootstrap_servers, "lineage.")
    events, ids = [], {}
    for group, (step, rewards) in PLAN.items():
        mine = [event("group_started", RUN, group_index=group, step=step, n_samples=2)]
        mine += [sample(RUN, group, rollout, reward, sample_index=group * 10 + rollout)
                 for rollout, reward in enumerate(rewards)]
        ids[group] = [e["event_id"] for e in mine]
        events += mine
    # A third rollout for group 0 once it has its two: refused, dead-lettered under group 0.
    rejected = sample(RUN, 0, 7, 1.0)
    events.insert(3, rejected)
    publish(kafka, RUN, CONFIG, events)
    lake_root = root / "lake"
    run_processor(kafka, str(lake_root))

    ds_config = root / "ds.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--lake", str(lake_root), "--run", RUN,
         "--model", "tiny", "--deepspeed", str(ds_config), "--steps", "2",
         "--output-dir", str(root / "out"), "--poll-interval-s", "0.1",
         "--until-idle-s", "30", "--wandb-mode", "disabled"],
        cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
        timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {"lake": Lake(lake_root), "root": str(lake_root), "ids": ids,
            "rejected": rejected, "topic": kafka.topics.events}


def test_trainer_step_back_to_events_and_forward_again(trained):
    snap = Snapshot(trained["lake"])
    for step, groups in TRAINED.items():
        back = trainer_step_lineage(snap, RUN, step)
        assert back.trainer_step["update"] == step + 1  # the weights version it produced
        assert back.sealed["batch_version"] == back.trainer_step["batch_version"]
        assert back.content_verified
        assert {g.group_index for g in back.groups} == groups
        positions = sorted(p for g in back.groups for p in g.positions)
        assert positions == list(range(back.sealed["n_samples"]))
        for consumed in back.groups:
            assert consumed.decision["decision"] == "kept"
            assert [e["event_id"] for e in consumed.events] == trained["ids"][consumed.group_index]
            assert {e["topic"] for e in consumed.events} == {trained["topic"]}
            # Forward again: the group names the same step, batch version and update.
            forward = group_lineage(snap, RUN, consumed.group_index)
            assert [e["offset"] for e in forward.events] == [e["offset"] for e in consumed.events]
            assert all(e["ingested_at"] is not None for e in forward.events)
            assert [r["position"] for r in forward.training_rows] == consumed.positions
            assert forward.decision["batch_step"] == step
            assert forward.steps == [back.sealed]
            assert forward.trainer_steps == [back.trainer_step]
            for position in consumed.positions:
                row = row_lineage(snap, RUN, step, position)
                assert row.row["group_index"] == consumed.group_index
                assert row.group.trainer_steps == [back.trainer_step]


def test_dead_letters_and_dropped_group(trained):
    snap = Snapshot(trained["lake"])
    first = group_lineage(snap, RUN, 0)
    assert [e["event_id"] for e in first.events] == trained["ids"][0]
    [dead] = first.dead_letters
    assert dead["topic"] == trained["topic"]
    assert dead["raw_preview"] == orjson.dumps(trained["rejected"]).decode()[:RAW_PREVIEW_CHARS]
    assert "group 0" in dead["error"] or "exceeds the group's n_samples" in dead["error"]
    dropped = group_lineage(snap, RUN, 2)
    assert dropped.decision["decision"] == "dropped"
    assert dropped.decision["reason"].startswith("zero_std")
    assert dropped.training_rows == [] and dropped.trainer_steps == []


def test_as_of_reads_the_lake_as_it_was(trained):
    lake = trained["lake"]
    step0 = trainer_step_lineage(Snapshot(lake), RUN, 0).trainer_step
    # As of the commit that completed step 0's batch: its rows, no steps row yet (it is
    # committed after the rows), nothing trained.
    then = parse_as_of(lake, str(step0["batch_version"]))
    group = group_lineage(then, RUN, 0)
    assert [r["step"] for r in group.training_rows] == [0, 0]
    assert group.steps == [] and group.trainer_steps == []
    with pytest.raises(LineageNotFound, match="has no trainer_steps row for step 0 as of"):
        trainer_step_lineage(then, RUN, 0)
    # As of the trainer's commit of step 0, the trainer step is there.
    committed = lake.commit_times("trainer_steps")[lake.first_version_with("trainer_steps",
                                                                           "step = 0")]
    at_training = parse_as_of(lake, committed.isoformat())
    assert trainer_step_lineage(at_training, RUN, 0).trainer_step == step0
    with pytest.raises(LineageNotFound, match="has no events, groups or steps"):
        group_lineage(parse_as_of(lake, "2000-01-01T00:00:00"), RUN, 0)
    assert parse_as_of(lake, "2000-01-01T00:00:00").at == datetime(2000, 1, 1, tzinfo=UTC)
    with pytest.raises(InvalidInputError, match=r"as of '999': training_batches has no version 999"):
        parse_as_of(lake, "999")
    with pytest.raises(InvalidInputError, match="neither a training_batches version"):
        parse_as_of(lake, "yesterday")


def test_audit_command(trained):
    root = trained["root"]
    shown = cli("audit", "--lake", root, "--run", RUN, "--trainer-step", "1", "--json")
    assert shown.returncode == 0, shown.stderr
    back = json.loads(shown.stdout)
    assert {g["group_index"] for g in back["groups"]} == TRAINED[1]
    row = json.loads(cli("audit", "--lake", root, "--run", RUN, "--step", "1", "--position",
                         "0", "--json").stdout)
    assert row["group"]["trainer_steps"][0]["update"] == 2
    table = cli("audit", "--lake", root, "--run", RUN, "--group", "3")
    assert "produced weights version 2" in table.stdout
    assert "dead letter" in cli("audit", "--lake", root, "--run", RUN, "--group", "0").stdout
    errors = {
        ("--run", "nope", "--group", "0"): "run 'nope' has no events, groups or steps",
        ("--run", RUN, "--group", "99"): "group 99 of run 'lineage-run' has no archived events",
        ("--run", RUN, "--trainer-step", "7"): "no trainer_steps row for step 7 (trained "
                                               "steps 0..1)",
        ("--run", RUN, "--step", "0", "--position", "99"): "no training_batches row at step 0 "
                                                           "position 99",
        ("--run", RUN, "--group", "0", "--as-of", "soon"): "as of 'soon': neither",
        ("--run", RUN, "--step", "0"): "--step and --position go together",
    }
    for flags, message in errors.items():
        assert message in one_line_error(cli("audit", "--lake", root, *flags))
