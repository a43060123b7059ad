"""`rolloutlake lake optimize|vacuum` on a processor's lake: vacuum keeps what a run under
retention reads (its batch versions, audit as of them), and deletes it once the run is not
under retention."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.io.lineage import Snapshot, group_lineage, parse_as_of, row_lineage
from ingest.io.retention import retained_runs
from schemas.tables import content_sha256
from tests.integration.pipeline import ordered_kafka, run_processor
from tests.integration.test_cli import cli, one_line_error

pytestmark = pytest.mark.one_broker("tests Delta maintenance of a processor's lake")

KEPT, OLD = "kept-run", "old-run"


@pytest.fixture(scope="module")
def two_runs(broker, tmp_path_factory) -> Path:
    """Both runs processed one after the other, so no version of `training_batches` that
    holds `old-run` rows is a batch version of `kept-run`."""
    kafka = ordered_kafka(broker.bootstrap_servers, "retention.")
    root = tmp_path_factory.mktemp("retention") / "lake"
    for seed, run_id in enumerate((KEPT, OLD)):
        run_simulation(kafka, SimulationConfig(run_id=run_id, steps=3, rollout_batch_size=2,
                                               n_samples=2, response_len_mean=16, prompt_len=4,
                                               mode="open", seed=seed))
        # Small polls: each run's steps sealed over several commits, files to compact.
        run_processor(kafka, str(root), idle_s=1.5, max_poll_records=4)
    lake = Lake(root)
    for run_id in (KEPT, OLD):
        versions = {s["batch_version"] for s in sealed(lake, run_id)}
        assert len(versions) > 1, f"{run_id} sealed in one commit: nothing to compact"
    return root


@pytest.fixture
def lake(two_runs, tmp_path) -> Lake:
    copy = tmp_path / "lake"
    shutil.copytree(two_runs, copy)
    return Lake(copy)


def sealed(lake: Lake, run_id: str) -> list[dict]:
    return sorted(lake.read("steps", filter=pc.field("run_id") == run_id).to_pylist(),
                  key=lambda s: s["step"])


def read_at_batch_version(lake: Lake, step: dict) -> str:
    """What the trainer reads for a step: its rows at the batch version, hashed."""
    rows = lake.read("training_batches", version=step["batch_version"],
                     filter=(pc.field("run_id") == step["run_id"]) & (pc.field("step") == step["step"]))
    return content_sha256(rows.sort_by("position"))


def parquet_files(lake: Lake) -> set[Path]:
    return set(Path(lake.root).rglob("*.parquet"))


def audits(lake: Lake) -> list[dict]:
    """Lineage of `kept-run`: each group now, one batch row, each group as of step 0's
    batch version."""
    now, then = Snapshot(lake), parse_as_of(lake, str(sealed(lake, KEPT)[0]["batch_version"]))
    groups = sorted(lake.read("groups", filter=pc.field("run_id") == KEPT)["group_index"].to_pylist())
    found = [group_lineage(now, KEPT, g) for g in groups]
    found.append(row_lineage(now, KEPT, 1, 0))
    found += [group_lineage(then, KEPT, g) for g in groups[:2]]
    return [f.model_dump() for f in found]


def test_vacuum_refuses_to_delete_what_a_retained_run_reads(lake):
    before = audits(lake)
    compacted = cli("lake", "optimize", "--lake", lake.root)
    assert compacted.returncode == 0, compacted.stderr
    assert "training_batches: compacted" in compacted.stdout

    files = parquet_files(lake)
    flags = ("lake", "vacuum", "--lake", lake.root, "--retention-hours", "0", "--keep-run", KEPT)
    dry = cli(*flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert parquet_files(lake) == files
    done = cli(*flags)
    assert done.returncode == 0, done.stderr
    assert f"runs under retention: {KEPT} (--keep-run)" in done.stdout
    refusal = next(ln for ln in done.stdout.splitlines() if ln.startswith("training_batches:"))
    assert refusal.endswith(f"that runs under retention still need for replay and audit ({KEPT})")
    assert refusal in dry.stdout.replace("would delete", "deleted")
    assert len(parquet_files(lake)) < len(files)

    # The retained run: every batch version reads as sealed, audit and replay unchanged.
    for step in sealed(lake, KEPT):
        assert read_at_batch_version(lake, step) == step["content_sha256"]
    assert audits(lake) == before
    replay = cli("replay", "--lake", lake.root, "--run", KEPT, "--check")
    assert replay.returncode == 0, replay.stderr
    assert "check: every step hash, decision and metric equals the original (3 steps)" in replay.stdout
    # The other run's early batch versions are gone: vacuum did delete.
    with pytest.raises(OSError):
        read_at_batch_version(lake, sealed(lake, OLD)[0])


def test_vacuum_deletes_them_once_no_run_is_under_retention(lake):
    cli("lake", "optimize", "--lake", lake.root).check_returncode()
    done = cli("lake", "vacuum", "--lake", lake.root, "--retention-hours", "0")
    assert done.returncode == 0, done.stderr
    assert "runs under retention: none" in done.stdout
    assert "refused" not in done.stdout
    with pytest.raises(OSError):
        read_at_batch_version(lake, sealed(lake, KEPT)[0])
    # The latest versions never depend on vacuum: replay still reproduces the run.
    replay = cli("replay", "--lake", lake.root, "--run", KEPT, "--check")
    assert replay.returncode == 0, replay.stderr


def test_a_run_is_under_retention_while_its_newest_data_is_younger(two_runs):
    lake = Lake(two_runs)
    newest = max(lake.read("events", filter=pc.field("run_id") == OLD)["ingested_at"].to_pylist())
    soon = newest + timedelta(minutes=30)
    assert set(retained_runs(lake, hours=1, now=soon)) == {KEPT, OLD}
    assert set(retained_runs(lake, hours=1, now=soon + timedelta(hours=1))) == set()
    assert set(retained_runs(lake, hours=1, now=soon + timedelta(hours=1),
                             keep=frozenset({KEPT}))) == {KEPT}


@pytest.mark.parametrize(("flags", "message"), [
    (["vacuum", "--retention-hours", "-1"], "argument --retention-hours: -1 is negative"),
    (["vacuum", "--retention-hours", "a week"], "'a week' is not a whole number of hours"),
    (["compact"], "invalid choice: 'compact'"),
])
def test_bad_maintenance_flags_are_one_line(tmp_path, flags, message):
    assert message in one_line_error(cli("lake", *flags, "--lake", str(tmp_path)))
