"""Partial rollout's pure parts: which round continues which recycled group, the loss mask
of a continued rollout, and the stored form of a recycled group."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from ingest.workers.config import WorkerConfig
from ingest.workers.partial import continuation_event_id, loss_mask, plan_round, prompt_of
from ingest.workers.prompts import Prompt
from schemas.partial import PartialGroup, PartialPrompt, PartialSample

PROMPT = PartialPrompt(text="1+1=", label="2", metadata={"source": "t"}, tokens=[5, 6, 7])


def recycled(group_index: int, as_group: int | None = None,
             as_step: int | None = None) -> PartialGroup:
    return PartialGroup(
        state="pending" if as_group is None else "claimed", run_id="run-a",
        group_index=group_index, step=0, prompt=PROMPT,
        samples=[PartialSample(rollout_id=0, status="cancelled", tokens=[9, 9],
                               log_probs=[-1.0, -2.0], versions=[0, 0]),
                 PartialSample(rollout_id=1, status="unsent")],
        as_group=as_group, as_step=as_step)


def test_pending_groups_take_the_rounds_first_indexes_in_recycle_order():
    plan, left = plan_round([recycled(3), recycled(1), recycled(2)], 2, [8, 9])
    assert [(g, s, r.group_index) for g, s, r in plan] == [(8, 2, 3), (9, 2, 1)]
    assert [r.group_index for r in left] == [2]


def test_claimed_groups_run_again_as_their_claim_and_keep_their_index_out_of_the_round():
    plan, left = plan_round([recycled(0, as_group=9, as_step=2), recycled(1),
                             recycled(5, as_group=4, as_step=1)], 2, [8, 9])
    assert [(g, s, r.group_index) for g, s, r in plan] == [(9, 2, 0), (4, 1, 5), (8, 2, 1)]
    assert left == []


def test_no_recycled_groups_plans_nothing():
    assert plan_round([], 0, [0, 1, 2, 3]) == ([], [])


def test_the_loss_mask_zeroes_only_tokens_of_older_weights_when_asked():
    assert loss_mask([3, 3, 4, 4], 4, mask_offpolicy=True) == [0, 0, 1, 1]
    assert loss_mask([3, 3, 4, 4], 4, mask_offpolicy=False) == [1, 1, 1, 1]
    assert loss_mask([4, 4], 4, mask_offpolicy=True) == [1, 1]


def test_a_recycled_group_survives_its_stored_form():
    group = recycled(7, as_group=12, as_step=3)
    body = orjson.loads(group.model_dump_json())
    assert (body["state"], body["run_id"], body["as_group"]) == ("claimed", "run-a", 12)
    assert PartialGroup.model_validate(body) == group
    assert prompt_of(group) == Prompt("1+1=", "2", {"source": "t"}, [5, 6, 7])


def test_a_record_whose_tokens_and_log_probs_disagree_is_refused():
    with pytest.raises(ValidationError, match="rollout 0: 2 tokens, 1 log-probs, 2 versions"):
        PartialSample(rollout_id=0, status="cancelled", tokens=[1, 2], log_probs=[-1.0],
                      versions=[0, 0])
    with pytest.raises(ValidationError, match="a claimed group has as_group None"):
        PartialGroup.model_validate({**recycled(1).model_dump(), "state": "claimed"})


def test_continuation_event_ids_name_run_groups_and_rollout():
    assert continuation_event_id("r", 3, 9, "finished", 1) == "r-g9-from-g3-finished-r1"
    assert continuation_event_id("r", 3, 9, "group_started") == "r-g9-from-g3-group_started"


def test_partial_rollout_takes_its_prompts_from_a_dataset_not_the_gateway(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValidationError, match="--partial-rollout continues groups under "
                                              "indexes the worker picks; it takes "
                                              "--prompt-data, not --prompts-from"):
        WorkerConfig(run="r", prompts_from="http://127.0.0.1:1", tokenizer=tmp_path,
                     custom_rm_path="m.rm", partial_rollout=True)
