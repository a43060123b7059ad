"""Lake: exactly-once appends against real Delta tables."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from pydantic import BaseModel, ValidationError

from ingest.io.lake import BackgroundCompaction, Lake, TxnMark
from ingest.io.lake_location import LakePath
from ingest.io.retention import compact
from schemas.errors import ConfigError
from schemas.tables import EVENTS, GROUPS, SAMPLES, STEP_METRICS


def _metric(step: int, key: str = "k") -> pa.Table:
    return pa.Table.from_pylist([{"run_id": "r", "step": step, "key": key, "value": 1.0}],
                                schema=STEP_METRICS.schema)


def test_a_replayed_mark_is_skipped_version_zero_included(tmp_path):
    lake = Lake(tmp_path)
    assert lake.append("step_metrics", _metric(0), [TxnMark("src:0", 0)]) is not None
    assert lake.append("step_metrics", _metric(0), [TxnMark("src:0", 0)]) is None
    assert lake.append("step_metrics", _metric(1), [TxnMark("src:0", 1)]) is not None
    assert lake.txn_version("step_metrics", "src:0") == 1
    assert lake.read("step_metrics").num_rows == 2


def test_a_lower_version_is_not_recorded(tmp_path):
    """delta-rs would accept a lower version silently; Lake refuses to go back."""
    lake = Lake(tmp_path)
    lake.append("step_metrics", _metric(5), [TxnMark("src:0", 5)])
    assert lake.append("step_metrics", _metric(3), [TxnMark("src:0", 3)]) is None
    assert lake.txn_version("step_metrics", "src:0") == 5


def test_two_writers_on_one_table_each_keep_their_marks(tmp_path):
    first, second = Lake(tmp_path), Lake(tmp_path)
    first.append("step_metrics", _metric(0, "a"), [TxnMark("a:0", 0)])
    second.append("step_metrics", _metric(0, "b"), [TxnMark("b:0", 0)])
    # `first` holds a stale snapshot; its commit still lands after the other writer's.
    first.append("step_metrics", _metric(1, "a"), [TxnMark("a:0", 1)])
    fresh = Lake(tmp_path)
    assert fresh.txn_version("step_metrics", "a:0") == 1
    assert fresh.txn_version("step_metrics", "b:0") == 0
    assert fresh.read("step_metrics").num_rows == 3


def test_a_commit_that_meets_another_writers_retries_and_says_so_at_info(tmp_path, caplog):
    """A conflict is expected now and then (a background compaction, another instance's
    commit): the retry is logged at info; a warning printed in the middle of `make demo`'s
    reward table."""
    caplog.set_level(logging.INFO, logger="ingest.io.lake")
    first, second = Lake(tmp_path), Lake(tmp_path)
    first.append("step_metrics", _metric(0), [TxnMark("src:0", 0)])
    assert second.txn_version("step_metrics", "src:0") == 0  # its snapshot, soon stale
    first.append("step_metrics", _metric(1), [TxnMark("src:0", 1)])
    assert second.append("step_metrics", _metric(2), [TxnMark("src:0", 2)]) is not None
    retries = [r for r in caplog.records if "concurrent commit on step_metrics" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.INFO]
    fresh = Lake(tmp_path)
    assert fresh.txn_version("step_metrics", "src:0") == 2
    assert sorted(fresh.read("step_metrics").column("step").to_pylist()) == [0, 1, 2]


def test_pruned_read_returns_only_matching_files(tmp_path):
    lake = Lake(tmp_path)
    for step in range(5):
        lake.append("step_metrics", _metric(step))
    rows = lake.read("step_metrics", prune="run_id = 'r' AND step = 3")
    assert rows.column("step").to_pylist() == [3]
    old = lake.read("step_metrics", version=2, filter=pc.field("step") >= 0)
    assert sorted(old.column("step").to_pylist()) == [0, 1]


def test_first_version_with_finds_the_commit_that_added_a_step(tmp_path):
    lake = Lake(tmp_path)
    versions = {step: lake.append("step_metrics", _metric(step)) for step in range(9)}
    for step, version in versions.items():
        assert lake.first_version_with("step_metrics", f"run_id = 'r' AND step = {step}") == version
    assert lake.first_version_with("step_metrics", "run_id = 'r' AND step = 99") is None


# Each of these makes delta-rs panic (^ [ ] |) or address another path (\\, %41 -> A).
@pytest.mark.parametrize("char", ["^", "[", "]", "|", "\\", "%", "\n"])
def test_lake_paths_delta_cannot_address_are_refused(tmp_path, char):
    root = str(tmp_path / f"a{char}41b")
    expected = (f"lake path {root!r} contains {char!r}, which Delta Lake cannot address; "
                "use a path without them")
    with pytest.raises(ConfigError) as raised:
        Lake(root)
    assert str(raised.value) == expected

    class Config(BaseModel):
        lake: LakePath

    with pytest.raises(ValidationError) as invalid:
        Config(lake=root)
    assert invalid.value.errors()[0]["msg"] == expected
    assert list(tmp_path.iterdir()) == []


def test_a_lake_folder_that_cannot_be_made_is_one_error_naming_it(tmp_path):
    """A file where the lake's folder should go: the error names the lake, the table and
    the reason, where the OS error's traceback reached the user."""
    (tmp_path / "file").write_text("in the way")
    root = str(tmp_path / "file" / "lake")
    with pytest.raises(ConfigError) as raised:
        Lake(root).ensure("events")
    assert str(raised.value) == (f"cannot create the lake's events table under {root}: Not a "
                                 f"directory ({root}/events)")


@pytest.mark.parametrize("char", [" ", "#", "?", "{", "é", "'", "@", "~", ","])
def test_other_punctuation_in_a_lake_path_round_trips(tmp_path, char):
    root = tmp_path / f"a{char}b"
    Lake(root).append("step_metrics", _metric(1))
    assert Lake(root).read("step_metrics").num_rows == 1


def _one_row_groups(lake: Lake, count: int, first: int = 0) -> None:
    for g in range(first, first + count):
        row = {"run_id": "c", "group_index": g, "step": 0, "n_samples": 1, "decision": "kept",
               "decided_at": datetime.now(UTC)}
        lake.append("groups", pa.Table.from_pylist([row], schema=GROUPS.schema),
                    [TxnMark("groups-app", g)])


def test_background_compaction_keeps_a_tables_files_few_and_its_rows_and_marks(tmp_path):
    """A Delta append costs time in proportion to the files a table holds; the batch stage
    compacts its audit tables every `every` commits while it goes on committing."""
    compacted, plain = Lake(str(tmp_path / "compacted")), Lake(str(tmp_path / "plain"))
    compaction = BackgroundCompaction(compacted, ["groups"], every=5)
    BackgroundCompaction(plain, ["groups"], every=0)
    for lake in (compacted, plain):
        _one_row_groups(lake, 25)
        lake.append("samples", pa.Table.from_pylist(
            [{"run_id": "c", "group_index": 0, "rollout_id": 0, "fragment_index": 0,
              "status": "completed", "response_length": 1, "decision": "kept"}],
            schema=SAMPLES.schema))
    compaction.close()
    assert plain.active_files("groups") == 25
    # The last commit was a turn: compacted after it, even when the one before was still
    # running then (appends outpace compactions, the more so on a loaded machine).
    assert compacted.active_files("groups") == 1
    assert compacted.active_files("samples") == plain.active_files("samples") == 1
    for lake in (compacted, plain):
        groups = lake.read("groups", columns=["group_index"]).column("group_index").to_pylist()
        assert sorted(groups) == list(range(25))
        assert lake.txn_version("groups", "groups-app") == 24
    # a reader at a version before the compactions still reads it as it was
    early = DeltaTable(compacted.uri("groups"), version=5).to_pyarrow_table()
    assert sorted(early.column("group_index").to_pylist()) == list(range(5))


def _compact_at_once(lake: Lake, start: threading.Barrier) -> bool:
    """Whether `lake` compacted groups, started with the others waiting on `start`."""
    start.wait()
    try:
        lake.compact("groups")
    except CommitFailedError:
        return False
    return True


def test_two_compactions_of_the_same_files_at_once_keep_every_row_once(tmp_path):
    """Two processes compacting one table at once (two processor instances): delta-rs's
    own optimize lets the second commit too and every row is then in the table twice."""
    root = str(tmp_path / "lake")
    _one_row_groups(Lake(root), 2)
    failed = 0
    for round_ in range(8):
        _one_row_groups(Lake(root), 6, first=2 + 6 * round_)
        start = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(_compact_at_once, [Lake(root), Lake(root)], [start, start]))
        assert any(done)
        failed += done.count(False)
        groups = Lake(root).read("groups", columns=["group_index"]).column(0).to_pylist()
        assert sorted(groups) == list(range(2 + 6 * (round_ + 1))), f"round {round_}"
    assert failed, "the two compactions never overlapped: the test proved nothing"


def test_lake_optimize_beside_a_compaction_of_the_same_files_says_to_run_again(tmp_path):
    """`rolloutlake lake optimize` while a processor compacts the same table: a compaction
    that loses is one line saying so (no traceback), and the rows stay once."""
    root = str(tmp_path / "lake")
    said: list[str] = []
    for round_ in range(20):
        _one_row_groups(Lake(root), 6, first=6 * round_)
        start = threading.Barrier(2)
        with ThreadPoolExecutor(1) as pool:
            processor = pool.submit(_compact_at_once, Lake(root), start)
            start.wait()
            said.extend(r.line(dry_run=False) for r in compact(Lake(root)))
            processor.result()
        groups = Lake(root).read("groups", columns=["group_index"]).column(0).to_pylist()
        assert sorted(groups) == list(range(6 * (round_ + 1))), f"round {round_}"
        if any("not compacted" in line for line in said):
            break
    assert ("groups: not compacted: another writer (a running processor's compaction?) "
            "changed the same files meanwhile; run again") in said


def test_compacted_files_prune_reads_by_their_statistics_and_keep_partitions(tmp_path):
    """Readers skip files by their min/max statistics: a compacted file's must be exact, per
    run partition, with the events archive's payloads (no statistics) kept byte for byte."""
    lake = Lake(str(tmp_path / "lake"))
    payloads = {}
    for g in range(12):
        run = "a" if g % 2 else "b"
        payloads[(run, g)] = f'{{"event_id": "{g}", "tokens": "{"x" * (40 + g)}"}}'
        lake.append("events", pa.Table.from_pylist([{
            "run_id": run, "event_id": str(g), "type": "sample_finished", "group_index": g,
            "rollout_id": 0, "topic": "t", "partition": 0, "offset": g,
            "ingested_at": datetime.now(UTC), "payload": payloads[(run, g)]}],
            schema=EVENTS.schema), [TxnMark("events-app", g)])
    assert lake.compact("events") == {"added": 2, "removed": 12}
    assert lake.active_files("events") == 2
    for (run, g), payload in payloads.items():
        found = lake.read("events", filter=(pc.field("run_id") == run)
                          & (pc.field("group_index") == g)).to_pylist()
        assert [(r["run_id"], r["offset"], r["payload"]) for r in found] == [(run, g, payload)]
    assert lake.read("events", filter=pc.field("offset") > 100).num_rows == 0
    assert lake.txn_version("events", "events-app") == 11
    assert lake.compact("events") == {"added": 0, "removed": 0}  # nothing small left to pair


def test_a_compaction_that_fails_is_a_warning_and_commits_go_on(tmp_path, caplog):
    lake = Lake(str(tmp_path / "lake"))
    compaction = BackgroundCompaction(lake, ["groups"], every=5)
    _one_row_groups(lake, 4)
    for uri in lake.refresh("groups").file_uris()[:1]:  # a data file lost under the table
        Path(uri.removeprefix("file://")).unlink()
    _one_row_groups(lake, 6, first=4)
    compaction.close()
    assert "compacting groups's small files failed" in caplog.text
    assert lake.txn_version("groups", "groups-app") == 9
