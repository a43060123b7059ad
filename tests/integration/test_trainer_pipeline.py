"""Rollout events -> real broker -> stream processor -> Delta -> trainer -> weights_updated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow.compute as pc
import pytest

from ingest.io.lake import Lake
from schemas.control import WeightsUpdated
from tests.integration.pipeline import event, publish, run_processor, sample
from tests.support.gateway_support import consume_all

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _groups(run_id: str) -> list[dict]:
    """Two steps of two kept groups each; group 1 is a compacted rollout plus a plain one."""
    events = []
    for group in range(4):
        step = group // 2
        events.append(event("group_started", run_id, group_index=group, step=step, n_samples=2))
        if group == 1:
            events.append(
                event("compaction_fragment", run_id, group_index=1, rollout_id=0,
                      fragment_index=0, prompt_tokens=[1, 2], response_tokens=[5, 6, 7],
                      loss_mask=[1, 0, 1], rollout_log_probs=[-0.4, -0.5, -0.6])
            )  # fmt: skip
            events.append(sample(run_id, 1, 0, 1.0, sample_index=10, fragment_count=2))
        else:
            events.append(sample(run_id, group, 0, 1.0, sample_index=group * 10))
        events.append(sample(run_id, group, 1, 0.0, sample_index=group * 10 + 1, length=6))
    return events


def test_trainer_consumes_processor_steps_and_announces_weights(kafka, tmp_path):
    run_id = "pipeline-run"
    lake_root = tmp_path / "lake"
    publish(kafka, run_id, {"n_samples_per_prompt": 2, "rollout_batch_size": 2}, _groups(run_id))
    run_processor(kafka, str(lake_root))
    lake = Lake(lake_root)
    steps = sorted(lake.read("steps", filter=pc.field("run_id") == run_id).to_pylist(),
                   key=lambda r: r["step"])  # fmt: skip
    assert [s["step"] for s in steps] == [0, 1]

    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    command = [
        sys.executable, "-m", "trainer.main", "--lake", str(lake_root), "--run", run_id,
        "--model", "tiny", "--deepspeed", str(ds_config), "--steps", "2",
        "--output-dir", str(tmp_path / "out"), "--save-weights-every", "1",
        "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
        "--poll-interval-s", "0.1", "--until-idle-s", "30", "--wandb-mode", "disabled",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    trained = sorted(
        lake.read("trainer_steps", filter=pc.field("run_id") == run_id).to_pylist(),
        key=lambda r: r["step"],
    )
    # Step 0 is recorded once although a Delta transaction version of 0 is easy to
    # mistake for "none recorded".
    assert [(r["step"], r["batch_version"], r["content_sha256"]) for r in trained] == [
        (s["step"], s["batch_version"], s["content_sha256"]) for s in steps
    ]

    records = consume_all(kafka, kafka.topics.control)
    updates = [
        WeightsUpdated.model_validate(orjson.loads(r.value))
        for r in records
        if orjson.loads(r.value)["type"] == "weights_updated"
    ]
    assert {r.key for r in records} == {run_id.encode()}
    assert [(u.step, u.version) for u in updates] == [(0, 1), (1, 2)]
    for update in updates:
        assert (Path(update.path) / "model.safetensors").is_file()
