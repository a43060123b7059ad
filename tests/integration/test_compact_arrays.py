"""Compact token arrays through the real processor: one stream, both forms, same tables.

Real broker, real Delta tables; events go to Kafka as raw bytes, as another language's
producer would send them. Per-token fields are JSON lists, compact typed arrays
(schemas/token_arrays.py) or a mix of both within one event.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import orjson
import pyarrow.compute as pc

from ingest.commands.replay import archived_config, replay_run
from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.lake import Lake
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from schemas.token_arrays import TOKEN_FIELDS
from tests.integration.pipeline import (
    assert_keys_once,
    derived_tables,
    event,
    ordered_kafka,
    rows,
    run_processor,
    sample,
    sorted_run_table,
)
from tests.support.token_forms import b64, compact


def test_list_compact_and_mixed_streams_give_identical_tables_and_replay(broker, tmp_path):
    kafka = ordered_kafka(broker.bootstrap_servers, "compact.")
    sim = SimulationConfig(run_id="lists", steps=2, rollout_batch_size=2, n_samples=4,
                           response_len_mean=24, prompt_len=6, mode="open", seed=5,
                           compaction_rate=0.3, duplicate_rate=0.0, compact_arrays=False)
    # producer times of their own, so event times (and what follows them) match across runs
    events = [{**e, "ts": 1.7e9 + i / 1000}
              for i, e in enumerate(e for group in open_loop_groups(sim) for e in group.events)]
    rng = np.random.default_rng(0)
    forms = {
        "lists": lambda e: e,
        "compact": compact,
        # every event its own mix, so one stream and one group hold both forms
        "mixed": lambda e: compact(e, [f for f in TOKEN_FIELDS if rng.random() < 0.5]),
    }
    with RolloutPublisher(kafka) as pub:
        for run_id in forms:
            pub.run_started(run_id, sim.run_config())
        pub.flush()
        # interleaved, so each event has the same event time in all three runs
        for e in events:
            for run_id, form in forms.items():
                pub.send_raw(pub.topics.events, event_group_key(run_id, e["group_index"]),
                             orjson.dumps(form({**e, "run_id": run_id})))
    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=2.0)
    lake = Lake(lake_root)
    assert_keys_once(lake)
    payloads = [r["payload"] for r in rows(lake, "events", "mixed") if r["type"] != "run_started"]
    assert any('"b64"' in p for p in payloads) and any('"b64"' not in p and "tokens" in p
                                                      for p in payloads)
    expected = derived_tables(lake, "lists")
    assert len(expected["steps"]) == sim.steps
    assert sum(r["decision"] == "kept" for r in expected["groups"]) >= 2 * sim.rollout_batch_size
    for run_id in ("compact", "mixed"):
        got = derived_tables(lake, run_id)
        for name, table in expected.items():
            assert got[name] == table, (run_id, name)
    # the archive of `mixed` holds both forms; replaying it rebuilds the same batches
    effects = replay_run(lake, "mixed", archived_config(lake, "mixed")).effects
    replayed = {s.step: s.content_sha256 for e in effects for s in e.sealed}
    assert replayed == {r["step"]: r["content_sha256"] for r in expected["steps"]}
    replayed_rows = [s.rows for e in effects for s in e.sealed]
    stored = lake.read("training_batches", filter=pc.field("run_id") == "mixed").sort_by(
        [("step", "ascending"), ("position", "ascending")])
    assert sum(t.num_rows for t in replayed_rows) == stored.num_rows
    for replayed_table in replayed_rows:
        step = replayed_table.column("step")[0].as_py()
        original = stored.filter(pc.field("step") == step)
        assert replayed_table.column("response_tokens").equals(original.column("response_tokens"))
        assert replayed_table.column("rollout_log_probs").equals(
            original.column("rollout_log_probs"))


def started(run_id: str, group_index: int) -> dict[str, Any]:
    return event("group_started", run_id, group_index=group_index, step=group_index,
                 n_samples=2)


def test_malformed_compact_arrays_are_dead_lettered_naming_the_field(kafka, lake_root):
    """Each malformed compact array is one dead letter whose reason names the field; the
    runs around them give the same tables as a run that never saw them."""
    config = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}
    poison = {
        "response_tokens.b64": {"response_tokens": {"dtype": "int32", "b64": "AAA*"}},
        "prompt_tokens.dtype": {"prompt_tokens": {"dtype": "int64", "b64": b64([1, 2], "<i8")}},
        "rollout_log_probs.b64": {"rollout_log_probs": {"dtype": "float32",
                                                        "b64": base64.b64encode(b"\0" * 15).decode()}},
        "loss_mask": {"loss_mask": {"dtype": "int8", "b64": b64([1, 1], "<i1")}},
        "rollout_log_probs.2": {"rollout_log_probs": {"dtype": "float32",
                                                      "b64": b64([0, 0, math.nan, 0], "<f4")}},
        "response_tokens.1": {"response_tokens": {"dtype": "int32", "b64": b64([10, -3, 12, 13], "<i4")}},
        "loss_mask.0": {"loss_mask": {"dtype": "int8", "b64": b64([7, 1, 1, 1], "<i1")}},
    }

    def valid(run_id: str) -> list[dict[str, Any]]:
        events = [started(run_id, 0), compact(sample(run_id, 0, 0, 1.0, event_id="s0")),
                  compact(sample(run_id, 0, 1, 0.0, event_id="s1"), ["response_tokens"]),
                  started(run_id, 1), sample(run_id, 1, 0, 1.0, event_id="s2"),
                  compact(sample(run_id, 1, 1, 0.5, event_id="s3"))]
        return [{**e, "ts": 1.7e9 + i} for i, e in enumerate(events)]

    bad = [orjson.dumps({**sample("poisoned", 1, 0, 1.0, event_id=f"p-{field}"), **fields})
           for field, fields in poison.items()]
    with RolloutPublisher(kafka) as pub:
        for run_id in ("clean", "poisoned"):
            pub.run_started(run_id, config)
        pub.flush()
        # interleaved, so both runs' events have the same event times
        for index, pair in enumerate(zip(valid("clean"), valid("poisoned"), strict=True)):
            if index == 4:
                for raw in bad:
                    pub.send_raw(pub.topics.events, event_group_key("poisoned", 1), raw)
            for body in pair:
                pub.send_raw(pub.topics.events,
                             event_group_key(body["run_id"], body["group_index"]),
                             orjson.dumps(body))
    run_processor(kafka, lake_root, idle_s=2.0)
    lake = Lake(lake_root)
    errors = {r["raw"]: r["error"] for r in rows(lake, "dead_letters") if r["run_id"] == "poisoned"
              or (r["raw"] and b"p-" in r["raw"])}
    assert sorted(errors) == sorted(bad)
    for raw, (field, _fields) in zip(bad, poison.items(), strict=True):
        assert f": {field}: " in errors[raw], (field, errors[raw])
    for name, sort in (("groups", ["group_index"]), ("training_batches", ["step", "position"]),
                       ("samples", ["group_index", "rollout_id", "fragment_index"])):
        assert (sorted_run_table(lake, name, "poisoned", sort)
                == sorted_run_table(lake, name, "clean", sort)), name
    # per step: the two runs' steps rows are read in file order
    steps = {(r["run_id"], r["step"]): r["content_sha256"] for r in rows(lake, "steps")}
    assert sorted(steps) == [(run, step) for run in ("clean", "poisoned") for step in (0, 1)]
    assert [steps["poisoned", step] for step in (0, 1)] == [steps["clean", step] for step in (0, 1)]
