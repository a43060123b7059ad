"""The partial-rollout store on a real broker: what a restarted worker reads back."""

from __future__ import annotations

from ingest.workers.partial import PartialStore
from schemas.partial import PartialGroup, PartialPrompt, PartialSample

PROMPT = PartialPrompt(text="3+4=", label="7", tokens=[3, 4, 5])


def group(index: int, run_id: str = "run-a") -> PartialGroup:
    return PartialGroup(run_id=run_id, group_index=index, step=0, prompt=PROMPT, samples=[
        PartialSample(rollout_id=0, status="cancelled", tokens=[8], log_probs=[-0.5],
                      versions=[2]),
        PartialSample(rollout_id=1, status="completed", tokens=[9, 1], log_probs=[-1.0, -0.1],
                      versions=[2, 2])])


def test_a_restarted_worker_reads_pending_and_claimed_groups_in_recycle_order(kafka):
    writer = PartialStore(kafka, "run-a")
    other_run = PartialStore(kafka, "run-b")
    try:
        for index in (5, 2, 7, 4):
            writer.put(group(index))
        other_run.put(group(5, "run-b"))
        writer.claim(group(2), 10, 1)       # being continued as group 10 when it died
        writer.done(7)                      # continued
        writer.put(group(7))                # ...and a group 7 recycled again later
        writer.claim(group(4), 11, 1)
        writer.put(group(11))               # its continuation was cancelled and recorded
    finally:
        writer.close()
        other_run.close()
    reader = PartialStore(kafka, "run-a")
    try:
        loaded = reader.load()
        assert [(g.group_index, g.state, g.as_group, g.as_step) for g in loaded] == [
            (5, "pending", None, None), (2, "claimed", 10, 1), (7, "pending", None, None),
            (11, "pending", None, None)]
        assert loaded[0] == group(5)
        # Group 4's claim was finished but for its tombstone: the load wrote it done, so
        # once group 11 is continued in its turn, group 4 does not come back.
        reader.done(11)
        assert [g.group_index for g in reader.load()] == [5, 2, 7]
    finally:
        reader.close()
