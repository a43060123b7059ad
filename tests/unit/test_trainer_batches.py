"""Batch reader on real Delta tables: tensorisation, version pinning, verification."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from ingest.io.lake import Lake
from schemas.errors import BatchVerificationError
from schemas.tables import TRAINING_BATCHES, content_sha256
from tests.support.trainer_fixtures import batch_rows, random_step, seal_step
from trainer.batches import (
    StepFollower,
    StepPrefetcher,
    load_step,
    plan_micro_batches,
    read_sealed_rows,
)

HAND_ROWS = [
    # Rollout (0, 0) compacted into two siblings; the second has no rollout log-probs.
    dict(
        group_index=0,
        rollout_id=0,
        prompt_tokens=[1, 2],
        response_tokens=[3, 4, 5],
        loss_mask=[1, 1, 0],
        rollout_log_probs=[-0.1, -0.2, -0.3],
        advantage=0.5,
    ),
    dict(
        group_index=0,
        rollout_id=0,
        fragment_index=1,
        prompt_tokens=[6],
        response_tokens=[7],
        loss_mask=[1],
        advantage=0.5,
    ),
    dict(
        group_index=0,
        rollout_id=1,
        prompt_tokens=[8, 9, 10],
        response_tokens=[11, 12],
        loss_mask=[1, 1],
        rollout_log_probs=[-1.0, -2.0],
        advantage=-0.5,
    ),
    # Empty prompt: the first response token has no context and is not trained.
    dict(
        group_index=1,
        rollout_id=0,
        prompt_tokens=[],
        response_tokens=[13, 14],
        loss_mask=[1, 1],
        advantage=1.0,
    ),
]


@pytest.fixture
def lake(tmp_path):
    return Lake(tmp_path / "lake")


def _sealed(lake, step):
    return StepFollower(lake, "r1", poll_interval_s=0.01).sealed(step)


def test_tensorize_pads_and_aligns_targets(lake):
    seal_step(lake, batch_rows("r1", 1, HAND_ROWS))
    batch = load_step(lake, _sealed(lake, 1))
    assert batch.tokens.tolist() == [
        [1, 2, 3, 4, 5],
        [6, 7, 0, 0, 0],
        [8, 9, 10, 11, 12],
        [13, 14, 0, 0, 0],
    ]
    assert batch.attention_mask.sum(1).tolist() == [5, 2, 5, 2]
    # Index t scores token t+1.
    assert batch.response_mask.int().tolist() == [
        [0, 1, 1, 1],
        [1, 0, 0, 0],
        [0, 0, 1, 1],
        [1, 0, 0, 0],
    ]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(
        batch.old_log_probs,
        torch.tensor([[0, -0.1, -0.2, -0.3], [0, 0, 0, 0], [0, 0, -1, -2], [0, 0, 0, 0]]),
    )
    assert batch.has_old_log_probs.tolist() == [True, False, True, False]
    assert batch.advantages[:, 0].tolist() == [0.5, 0.5, -0.5, 1.0]
    assert batch.advantages.shape == batch.loss_mask.shape
    assert batch.response_lengths.tolist() == [3, 1, 2, 1]
    # Siblings share D = 2 + 1; the other rollouts keep their own sums.
    assert batch.rollout_mask_sums.tolist() == [3, 3, 2, 1]
    assert batch.rollout_index.tolist() == [0, 0, 1, 2]
    assert batch.n_rollouts == 3


def test_rows_slice_trims_padding(lake):
    seal_step(lake, batch_rows("r1", 1, HAND_ROWS))
    batch = load_step(lake, _sealed(lake, 1))
    micro = batch.rows(slice(1, 2))
    assert micro.tokens.tolist() == [[6, 7]]
    assert micro.loss_mask.tolist() == [[1.0]]
    assert micro.rollout_mask_sums.tolist() == [3.0]


def test_reader_pins_the_recorded_batch_version(lake):
    rows = random_step("r1", 1)
    version = seal_step(lake, rows)
    # A late write for the same step after sealing must not reach the trainer.
    lake.append(TRAINING_BATCHES.name, rows.slice(0, 1))
    sealed = _sealed(lake, 1)
    assert sealed.batch_version == version
    read = read_sealed_rows(lake, sealed)
    assert read.num_rows == rows.num_rows
    assert read.column("position").to_pylist() == list(range(rows.num_rows))
    # The same step at the latest version has the extra row and fails verification.
    latest = type(sealed)(
        **{**sealed.__dict__, "batch_version": lake.version(TRAINING_BATCHES.name)}
    )
    with pytest.raises(BatchVerificationError, match="read 21 rows, the steps table recorded 20"):
        read_sealed_rows(lake, latest)


def test_hash_mismatch_stops_with_a_clear_error(lake):
    rows = random_step("r1", 2)
    seal_step(lake, rows, sha256="0" * 64)
    with pytest.raises(BatchVerificationError) as info:
        load_step(lake, _sealed(lake, 2))
    message = str(info.value)
    assert "run r1 step 2" in message
    assert "content_sha256" in message and "0" * 64 in message


def test_changed_value_fails_verification(lake):
    rows = random_step("r1", 4)
    column = rows.schema.get_field_index("advantage")
    tampered = rows.set_column(column, "advantage", pc.add(rows.column("advantage"), 1.0))
    seal_step(lake, tampered, sha256=content_sha256(rows))
    with pytest.raises(BatchVerificationError, match="changed after sealing"):
        load_step(lake, _sealed(lake, 4))


def test_follower_waits_and_finds_the_first_step(lake):
    follower = StepFollower(lake, "r1", poll_interval_s=0.01)
    assert follower.wait_for(None, idle_timeout_s=0.05) is None
    seal_step(lake, random_step("r1", 5))
    seal_step(lake, random_step("r1", 3))
    seal_step(lake, random_step("other", 1))
    assert follower.wait_for(None, idle_timeout_s=1).step == 3
    assert follower.wait_for(5, idle_timeout_s=1).step == 5
    assert follower.wait_for(4, idle_timeout_s=0.05) is None


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_micro_batch_plan_covers_rows_in_equal_counts(world_size):
    lengths = np.array([100, 5, 5, 5, 300, 20, 20, 20, 20, 80, 7])
    plans = [
        plan_micro_batches(lengths, world_size=world_size, rank=r, max_tokens=64)
        for r in range(world_size)
    ]
    assert len({len(p) for p in plans}) == 1
    covered = [i for plan in plans for part in plan for i in range(part.start, part.stop)]
    assert covered == list(range(len(lengths)))
    assert all(part.stop > part.start for plan in plans for part in plan)


def test_micro_batch_plan_respects_the_token_budget():
    lengths = np.full(64, 100)
    plan = plan_micro_batches(lengths, world_size=1, rank=0, max_tokens=1000)
    assert len(plan) == 7
    assert max(lengths[p].sum() for p in plan) <= 1000


def test_fewer_rows_than_ranks_is_an_error():
    with pytest.raises(BatchVerificationError, match="fewer than the 4"):
        plan_micro_batches(np.array([1, 2, 3]), world_size=4, rank=0, max_tokens=10)


def test_missing_batch_file_is_a_verification_error(lake, tmp_path):
    seal_step(lake, random_step("r1", 3))
    removed = [path for path in (tmp_path / "lake" / TRAINING_BATCHES.name).rglob("*.parquet")]
    assert removed
    for path in removed:
        path.unlink()
    with pytest.raises(BatchVerificationError) as info:
        load_step(lake, _sealed(lake, 3))
    message = str(info.value)
    assert "run r1 step 3" in message and "missing" in message
    assert removed[0].name in message and "\n" not in message


def test_prefetcher_loads_the_next_step_while_the_caller_trains_on_the_current_one(lake):
    for step in (1, 2, 3):
        seal_step(lake, random_step("r1", step, seed=step))
    loaded = {step: threading.Event() for step in (1, 2, 3)}
    requested = [1]  # steps the training loop has asked for so far
    load_starts = []

    def recording_load(lake, sealed):
        load_starts.append((sealed.step, len(requested)))
        batch = load_step(lake, sealed)
        loaded[sealed.step].set()
        return batch

    follower = StepFollower(lake, "r1", poll_interval_s=0.01)
    with StepPrefetcher(follower, None, load=recording_load) as prefetched:
        handed = []
        for step in (1, 2, 3):
            sealed, batch = prefetched.next(idle_timeout_s=30)
            handed.append(sealed.step)
            expected = load_step(lake, _sealed(lake, sealed.step))
            assert torch.equal(batch.tokens, expected.tokens)
            if step < 3:
                # "Training" step s: step s+1 gets loaded meanwhile, before the loop asks.
                assert loaded[step + 1].wait(timeout=30)
                requested.append(step + 1)
        assert prefetched.next(idle_timeout_s=0.05) is None
    assert handed == [1, 2, 3]
    # One step ahead, no more: step s+1 starts loading once step s was handed out.
    assert load_starts == [(1, 1), (2, 1), (3, 2)]


def test_prefetched_verification_failure_stops_with_the_error_of_that_step(lake):
    seal_step(lake, random_step("r1", 1))
    seal_step(lake, random_step("r1", 2), sha256="0" * 64)
    with pytest.raises(BatchVerificationError) as direct:
        load_step(lake, _sealed(lake, 2))
    follower = StepFollower(lake, "r1", poll_interval_s=0.01)
    with StepPrefetcher(follower, 1) as prefetched:
        sealed, _ = prefetched.next(idle_timeout_s=30)
        assert sealed.step == 1
        with pytest.raises(BatchVerificationError) as prefetched_error:
            prefetched.next(idle_timeout_s=30)
    assert str(prefetched_error.value) == str(direct.value)
    assert "run r1 step 2" in str(direct.value)


def test_leaving_the_prefetcher_stops_its_thread_while_it_waits_for_a_step(lake):
    follower = StepFollower(lake, "r1", poll_interval_s=0.01)
    with StepPrefetcher(follower, 7) as prefetched:
        assert prefetched.next(idle_timeout_s=0.05) is None
    assert "step-prefetch" not in [thread.name for thread in threading.enumerate()]
