"""Miles `Sample` groups published with the adapter reach `training_batches` as they were."""

from __future__ import annotations

from ingest.sdk.miles import miles_run_config, publish_miles_group
from ingest.sdk.publisher import RolloutPublisher
from tests.integration.pipeline import by_group, rows, run_processor
from tests.support.miles_samples import Sample, miles_sample


def test_miles_groups_land_in_training_batches_with_their_tokens_and_rewards(kafka, lake_root):
    run = "miles-adapter"
    args = type("Args", (), {"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                             "over_sampling_batch_size": 2, "reward_key": "score"})()
    kept = [miles_sample(0, 0, prompt_tokens=[1, 2], response_tokens=[10, 11, 12],
                         reward={"score": 1.0}, loss_mask=[1, 0, 1], weight_versions=["4"],
                         rollout_log_probs=[-0.5, -1.5, -2.5]),
            miles_sample(0, 1, prompt_tokens=[1, 2], response_tokens=[13],
                         reward={"score": 0.0}, status=Sample.Status.TRUNCATED,
                         weight_versions=["4"], rollout_log_probs=None)]
    aborted = [miles_sample(1, 2, prompt_tokens=[3], response_tokens=[14],
                            reward={"score": 1.0}),
               miles_sample(1, 3, prompt_tokens=[3], response_tokens=[15, 16],
                            status=Sample.Status.ABORTED)]
    for group in (kept, aborted):
        for sample in group:
            sample.prompt = "p"
    with RolloutPublisher(kafka, producer_id="miles") as publisher:
        publisher.run_started(run, miles_run_config(args))
        publisher.flush()
        publish_miles_group(publisher, run, kept, step=0)
        publish_miles_group(publisher, run, aborted, step=0)
    run_processor(kafka, lake_root)

    decided = {g: (r["decision"], r["reason"]) for g, r in by_group(lake_root, run).items()}
    assert decided == {0: ("kept", None), 1: ("dropped", "group_has_aborted")}
    batch = sorted(rows(lake_root, "training_batches", run), key=lambda r: r["rollout_id"])
    assert [(r["group_index"], r["rollout_id"], r["sample_index"]) for r in batch] == [
        (0, 0, 0), (0, 1, 1)]
    assert [r["prompt_tokens"] for r in batch] == [[1, 2], [1, 2]]
    assert [r["response_tokens"] for r in batch] == [[10, 11, 12], [13]]
    assert [r["loss_mask"] for r in batch] == [[1, 0, 1], [1]]
    assert batch[0]["rollout_log_probs"] == [-0.5, -1.5, -2.5]
    assert [r["reward"] for r in batch] == [1.0, 0.0]
    assert [r["status"] for r in batch] == ["completed", "truncated"]
    assert [r["weight_version"] for r in batch] == [4, 4]
