"""The spool between the stages of one processor instance (ingest/io/spool.py): what it
carries, what it refuses to read, and what it removes."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ingest.io.spool import HEADER, LOCK, DecisionSpool, remove_expired, spooled_value


class _Record:
    def __init__(self, headers: list[tuple[str, bytes]], value: bytes = b""):
        self.headers = headers
        self.value = value


def test_only_values_bound_for_owned_partitions_are_carried_and_read_back(tmp_path):
    spool = DecisionSpool.create(tmp_path)
    assert spool is not None
    # the batch stage is another process with the same folder
    DecisionSpool(spool.folder).own({1, 3})
    values = [b"a" * 10, b"", b"bbb", b"cc", b"dddd"]
    refs = spool.carry(values, [1, 1, 0, 3, 2])
    assert [ref is not None for ref in refs] == [True, False, False, True, False]
    assert refs[0] is not None and refs[3] is not None
    assert refs[0].path == refs[3].path  # one file per call
    assert spool.folder.stat().st_mode & 0o077 == 0  # no other user reads the tokens
    value, unread = spooled_value(_Record([("decision", b"{}"), refs[3].header()]))
    assert unread is None and value.to_pybytes() == b"cc"
    assert refs[0].read().to_pybytes() == b"a" * 10
    assert spooled_value(_Record([("decision", b"{}")], b"inline")) == (b"inline", None)


def test_nothing_is_carried_before_the_batch_stage_says_what_it_owns(tmp_path):
    spool = DecisionSpool.create(tmp_path)
    assert spool.carry([b"abc"], [0]) == [None]
    DecisionSpool(spool.folder).own({0})
    assert spool.carry([b"abc"], [0])[0] is not None
    DecisionSpool(spool.folder).own(set())  # revoked
    assert spool.carry([b"abc"], [0]) == [None]


def test_a_reference_of_another_boot_or_past_a_files_end_or_to_a_removed_file_is_unread(
        tmp_path):
    spool = DecisionSpool.create(tmp_path)
    spool.own({0})
    ref = spool.carry([b"0123456789"], [0])[0]
    assert ref is not None and ref.read().to_pybytes() == b"0123456789"
    assert replace(ref, boot="another-boot").read() is None
    assert replace(ref, length=11).read() is None
    assert replace(ref, path=str(tmp_path / "elsewhere")).read() is None
    value, unread = spooled_value(_Record([replace(ref, path=str(tmp_path / "x")).header()]))
    assert value is None and "not in this host's spool" in unread
    mapped = ref.read()
    Path(ref.path).unlink()
    assert ref.read() is None
    assert mapped.to_pybytes() == b"0123456789"  # bytes already read stay valid


def test_the_oldest_files_are_removed_past_the_size_kept(tmp_path):
    spool = DecisionSpool.create(tmp_path)
    spool.own({0})
    spool.max_bytes = 25
    first, second, third = (spool.carry([bytes([i]) * 10], [0])[0] for i in range(3))
    assert first.read() is None
    assert second.read().to_pybytes() == b"\x01" * 10
    assert third.read().to_pybytes() == b"\x02" * 10


def test_the_oldest_files_are_removed_past_the_age_kept(tmp_path):
    spool = DecisionSpool.create(tmp_path)
    spool.own({0})
    spool.keep_s = 0.2
    old = spool.carry([b"old"], [0])[0]
    time.sleep(0.3)
    new = spool.carry([b"new"], [0])[0]
    assert old.read() is None
    assert new.read().to_pybytes() == b"new"


def test_a_removed_folder_owns_nothing_and_the_batch_stage_saying_so_does_not_fail(tmp_path):
    spool = DecisionSpool.create(tmp_path)
    child = DecisionSpool(spool.folder)
    child.own({0, 1})
    assert spool.owned() == {0, 1}
    spool.remove()
    assert not spool.folder.exists()
    child.own({0})  # the child's last release, after the parent removed the folder
    assert spool.owned() == frozenset()
    assert spool.carry([b"abc"], [0]) == [None]


def test_a_full_disk_leaves_the_values_in_the_decisions(tmp_path, caplog):
    spool = DecisionSpool.create(tmp_path)
    spool.own({0})
    # the next file is /dev/full, where every write fails with ENOSPC
    (spool.folder / f"{spool._seq + 1:012d}.arrow").symlink_to("/dev/full")
    assert spool.carry([b"abc"], [0]) == [None]
    assert "cannot write" in caplog.text
    assert not (spool.folder / f"{spool._seq:012d}.arrow").is_symlink()
    assert spool.carry([b"abc"], [0])[0] is not None  # the next poll's file is written


def _instance_folder(root: Path, name: str, ages_s: list[float]) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / LOCK).touch()
    now = time.time()
    for i, age in enumerate(ages_s):
        file = folder / f"{i:012d}.arrow"
        file.write_bytes(b"x")
        os.utime(file, (now - age, now - age))
    return folder


def test_expired_files_of_gone_instances_are_removed_and_live_instances_kept(tmp_path):
    live = DecisionSpool.create(tmp_path)
    live.own({0})
    live_file = Path(live.carry([b"x"], [0])[0].path)
    old = time.time() - 1000
    os.utime(live_file, (old, old))
    gone = _instance_folder(tmp_path, "1-gone", [1000.0, 1.0])
    gone_all_old = _instance_folder(tmp_path, "2-gone", [1000.0])
    unrelated = tmp_path / "not-a-spool"
    unrelated.mkdir()
    remove_expired(tmp_path, keep_s=60.0)
    assert sorted(p.name for p in gone.iterdir()) == ["000000000001.arrow", LOCK]
    assert not gone_all_old.exists()
    assert live_file.exists()  # its instance holds the lock
    assert unrelated.exists()
    # a later start finds the rest expired
    os.utime(gone / "000000000001.arrow", (old, old))
    DecisionSpool.create(tmp_path)
    assert not gone.exists()


@pytest.mark.parametrize("raw, named", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "is not {boot"),
    (b'{"boot": "b", "path": "p", "offset": 0}', "is not {boot"),
    (b'{"boot": "b", "path": "p", "offset": "0", "length": 1}', "is not {boot"),
    (b'{"boot": "b", "path": "p", "offset": true, "length": 1}', "is not {boot"),
    (b'{"boot": "b", "path": "p", "offset": -1, "length": 1}', "negative"),
])
def test_a_malformed_spool_header_is_an_unread_reference_naming_the_header(raw, named):
    value, unread = spooled_value(_Record([(HEADER, raw)], b""))
    assert value is None and "spool header" in unread and named in unread
