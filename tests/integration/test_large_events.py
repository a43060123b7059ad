"""An 8 MiB event passes end to end: SDK -> Kafka -> processor -> sealed batch in Delta."""

from __future__ import annotations

import pyarrow.compute as pc

from ingest.io.kafka import read_topics
from ingest.io.lake import Lake
from ingest.processor.decisions import decision_header
from ingest.sdk.publisher import RolloutPublisher
from schemas.tables import content_sha256
from tests.integration.pipeline import ordered_kafka, run_processor

# The SDK sends int32 tokens in base64, 16/3 bytes each: about 7.9 MiB of JSON
TOKENS = 1_550_000


def test_eight_mib_sample_reaches_a_sealed_batch(broker, tmp_path):
    kafka = ordered_kafka(broker.bootstrap_servers, "big.")
    with RolloutPublisher(kafka) as pub:
        pub.run_started("big", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
        pub.group_started("big", group_index=0, step=0, n_samples=2)
        pub.sample_finished("big", group_index=0, rollout_id=0, status="truncated",
                            prompt_tokens=[1], response_tokens=[100000] * TOKENS, reward=1.0)
        pub.sample_finished("big", group_index=0, rollout_id=1, status="completed",
                            prompt_tokens=[1], response_tokens=[5], reward=0.0)
    run_processor(kafka, str(tmp_path), idle_s=2.0)
    lake = Lake(tmp_path)
    steps = lake.read("steps").to_pylist()
    assert [s["step"] for s in steps] == [0]
    rows = lake.read("training_batches", version=steps[0]["batch_version"],
                     filter=pc.field("run_id") == "big").sort_by("position")
    lengths = [len(r) for r in rows.column("response_tokens").to_pylist()]
    assert lengths == [TOKENS, 1]
    assert rows.column("loss_mask")[0].values.to_numpy().sum() == TOKENS
    assert steps[0]["content_sha256"] == content_sha256(rows)
    assert lake.read("dead_letters").num_rows == 0
    # The decision was too large to carry the fragments inline: they came from the archive.
    headers = [decision_header(r) for r in read_topics(kafka, [kafka.topics.decisions],
                                                       what="test", timeout_s=60)]
    decided = [h for h in headers if h is not None]
    assert [h.fragments_in_archive for h in decided] == [True]
