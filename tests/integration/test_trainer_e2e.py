"""The trainer end to end on CPU: real Delta, real torch, real DeepSpeed (ZeRO 0 and 2).

Each trainer is a separate `python -m trainer.main` process, as in production, so the kill
test can SIGKILL it mid-step. The reference runs of both stages train concurrently to keep
the module within about a minute on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from ingest.io.lake import Lake
from schemas.tables import STEPS
from tests.support.trainer_fixtures import random_step, seal_step

pytestmark = pytest.mark.slow

RUN = "e2e-run"
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # a loaded CI machine: two trainers import torch and DeepSpeed at once


def seal_run(root: Path) -> Lake:
    """Steps 1-3; step 2 is large enough (many micro-batches) that a kill lands inside it."""
    lake = Lake(root / "lake")
    seal_step(lake, random_step(RUN, 1, seed=7))
    seal_step(lake, random_step(RUN, 2, seed=7, n_groups=8, n_samples=8, response_len=64))
    seal_step(lake, random_step(RUN, 3, seed=7))
    return lake


def start_trainer(root: Path, stage: int) -> subprocess.Popen:
    ds_config = root / f"ds_zero{stage}.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    command = [
        sys.executable, "-m", "trainer.main",
        "--lake", str(root / "lake"), "--run", RUN, "--model", "tiny",
        "--deepspeed", str(ds_config), "--steps", "3", "--output-dir", str(root / "out"),
        "--save-weights-every", "1", "--lr", "1e-3", "--max-tokens-per-micro-batch", "512",
        "--poll-interval-s", "0.1", "--until-idle-s", "30", "--wandb-mode", "disabled",
    ]  # fmt: skip
    log = (root / "trainer.log").open("a")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, root: Path) -> None:
    assert process.wait(timeout=START_TIMEOUT_S) == 0, (root / "trainer.log").read_text()[-3000:]


def trainer_rows(lake: Lake) -> list[dict]:
    rows = lake.read("trainer_steps", filter=pc.field("run_id") == RUN).to_pylist()
    return sorted(rows, key=lambda r: r["step"])


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "out" / RUN / "weights" / "step_000000003" / "model.safetensors")


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> dict[int, Path]:
    roots = {stage: tmp_path_factory.mktemp(f"zero{stage}") for stage in (0, 2)}
    processes = {}
    for stage, root in roots.items():
        seal_run(root)
        processes[stage] = start_trainer(root, stage)
    for stage, process in processes.items():
        finish(process, roots[stage])
    return roots


def one_line_exit(process, tmp_path) -> str:
    """The trainer exited 2 with one `rolloutlake trainer:` line and no traceback."""
    assert process.wait(timeout=START_TIMEOUT_S) == 2
    output = (tmp_path / "trainer.log").read_text()
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("rolloutlake trainer:")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.mark.parametrize("stage", [0, 2])
def test_each_sealed_step_is_trained_once_and_recorded(reference_runs, stage):
    root = reference_runs[stage]
    lake = Lake(root / "lake")
    rows = trainer_rows(lake)
    steps = sorted(
        lake.read(STEPS.name, filter=pc.field("run_id") == RUN).to_pylist(),
        key=lambda r: r["step"],
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [(r["batch_version"], r["content_sha256"]) for r in rows] == [
        (s["batch_version"], s["content_sha256"]) for s in steps
    ]
    assert [r["update"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["tokens"] > row["loss_tokens"] > 0
        assert row["grad_norm"] > 0 and row["lr"] == pytest.approx(1e-3)
        assert 0 <= row["pg_clipfrac"] <= 1
        assert row["pg_clipfrac"] == pytest.approx(row["pg_clipfrac_low"] + row["pg_clipfrac_high"])
        assert row["kl"] is None  # no reference model configured
        assert row["log_ratio_clamped_tokens"] == 0  # rollout log-probs near the policy's
    assert 0 < rows[0]["entropy"] <= torch.log(torch.tensor(512.0)).item() + 1e-4
    weights = root / "out" / RUN / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [f"step_{s:09d}" for s in (1, 2, 3)]
    # The policy moved: step 3's weights differ from step 1's.
    first = load_file(weights / "step_000000001" / "model.safetensors")
    last = final_weights(root)
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_zero2_trains_the_same_model_as_zero0(reference_runs):
    zero0, zero2 = (trainer_rows(Lake(reference_runs[s] / "lake")) for s in (0, 2))
    for a, b in zip(zero0, zero2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    w0, w2 = final_weights(reference_runs[0]), final_weights(reference_runs[2])
    for name in w0:
        torch.testing.assert_close(w0[name], w2[name], rtol=1e-4, atol=1e-5)


def wait_for_line(path: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while text not in path.read_text():
        assert process.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.02)


def test_kill_during_step_2_then_restart_trains_each_step_once(reference_runs, tmp_path):
    lake = seal_run(tmp_path)
    process = start_trainer(tmp_path, 0)
    wait_for_line(tmp_path / "trainer.log", "step 2: training", process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL

    # The kill landed inside step 2: only step 1 is durable.
    assert [r["step"] for r in trainer_rows(lake)] == [1]
    latest = (tmp_path / "out" / RUN / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000000001"

    finish(start_trainer(tmp_path, 0), tmp_path)
    rows = trainer_rows(lake)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert "resumed from" in (tmp_path / "trainer.log").read_text()

    # Same updates as the uninterrupted run: a step trained twice or skipped would move
    # the weights elsewhere.
    reference = trainer_rows(Lake(reference_runs[0] / "lake"))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-6)
    expected = final_weights(reference_runs[0])
    restarted = final_weights(tmp_path)
    for name in expected:
        torch.testing.assert_close(restarted[name], expected[name], rtol=1e-6, atol=1e-7)


def test_missing_batch_file_stops_the_trainer_with_one_line(tmp_path):
    lake = seal_run(tmp_path)
    for path in (tmp_path / "lake" / "training_batches").rglob("*.parquet"):
        path.unlink()
    process = start_trainer(tmp_path, 0)
    error = one_line_exit(process, tmp_path)
    assert f"run {RUN} step 1" in error and "missing" in error
    assert lake.read("trainer_steps").num_rows == 0


def test_changed_next_step_stops_the_trainer_after_the_step_before_it(tmp_path):
    """Step 2 is read while step 1 trains; its failed verification still ends the run with
    step 2's one-line error, after step 1 was trained and recorded."""
    lake = Lake(tmp_path / "lake")
    seal_step(lake, random_step(RUN, 1, seed=7))
    seal_step(lake, random_step(RUN, 2, seed=7), sha256="0" * 64)
    process = start_trainer(tmp_path, 0)
    error = one_line_exit(process, tmp_path)
    assert f"run {RUN} step 2" in error and "changed after sealing" in error
    assert [row["step"] for row in trainer_rows(lake)] == [1]
