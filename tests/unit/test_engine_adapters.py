"""Request and response mappings of the engine adapters (no engine needed).

vLLM bodies are as vLLM 0.32 (CPU build) answered `/v1/completions` with `logprobs: 0`
and `return_tokens_as_token_ids: true` on the tiny policy. SGLang bodies follow SGLang's
own source, sgl-project/sglang:
- `test/srt/test_srt_endpoint.py`: `/generate` with `return_logprob`, whose
  `meta_info.output_token_logprobs` items are `[logprob, token_id, text]`;
- `python/sglang/srt/managers/schedule_batch.py`: `FINISH_MATCHED_TOKEN.to_json()` is
  `{"type": "stop", "matched": ...}`, `FINISH_LENGTH` `{"type": "length", "length": n}`,
  `FINISH_ABORT` `{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}`;
- `python/sglang/srt/managers/io_struct.py`: `UpdateWeightFromDiskReqInput(model_path,
  load_format, abort_all_requests, weight_version: Optional[str])`, and `AbortReq.rid`
  for `/abort_request` (`python/sglang/srt/entrypoints/http_server.py`).
"""

from __future__ import annotations

import dataclasses

import pytest

from ingest.workers.engines import (
    EngineError,
    Sampling,
    parse_sglang_generate,
    parse_vllm_completion,
    sglang_generate_body,
    sglang_weights_body,
    vllm_completion_body,
    vllm_request_id,
)

SAMPLING = Sampling(temperature=0.7, top_p=0.9, max_new_tokens=5)


def vllm_answer(tokens, log_probs, finish_reason):
    return {
        "id": "cmpl-9c09b9295efbaba5", "object": "text_completion", "model": "/tmp/tiny",
        "choices": [{
            "index": 0, "text": "", "finish_reason": finish_reason, "stop_reason": None,
            "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "logprobs": {
                "text_offset": [11 * i for i in range(len(tokens))],
                "token_logprobs": log_probs,
                "tokens": [f"token_id:{t}" for t in tokens],
                "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(tokens, log_probs, strict=True)],
            },
        }],
        "usage": {"prompt_tokens": 4, "completion_tokens": len(tokens)},
    }


def test_vllm_body_sends_token_ids_and_asks_for_sampled_log_probs():
    body = vllm_completion_body([5, 6, 41, 7], SAMPLING, "run-1/g0/r3")
    assert body["prompt"] == [5, 6, 41, 7]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["request_id"] == "run-1/g0/r3"
    assert vllm_request_id("run-1/g0/r3") == "cmpl-run-1/g0/r3-0"


def test_ignore_eos_reaches_both_engines_only_when_asked():
    """vLLM takes `ignore_eos` beside the OpenAI fields, SGLang inside `sampling_params`."""
    fixed = dataclasses.replace(SAMPLING, ignore_eos=True)
    assert vllm_completion_body([5], fixed, "r")["ignore_eos"] is True
    assert sglang_generate_body([5], fixed, "r")["sampling_params"]["ignore_eos"] is True
    assert "ignore_eos" not in vllm_completion_body([5], SAMPLING, "r")
    assert "ignore_eos" not in sglang_generate_body([5], SAMPLING, "r")["sampling_params"]


def test_vllm_gets_a_per_request_seed_only_when_one_is_set():
    seeded = dataclasses.replace(SAMPLING, seed=7 * 2**32 + 3)
    assert vllm_completion_body([5], seeded, "r")["seed"] == 7 * 2**32 + 3
    assert "seed" not in vllm_completion_body([5], SAMPLING, "r")


@pytest.mark.parametrize(("reason", "status"),
                         [("length", "truncated"), ("stop", "completed"), ("abort", "aborted")])
def test_vllm_answer_maps_tokens_log_probs_and_finish_reason(reason, status):
    lps = [-4.271625995635986, -4.445950508117676, -4.180430889129639]
    generation = parse_vllm_completion(vllm_answer([30, 31, 39], lps, reason))
    assert generation.tokens == [30, 31, 39]
    assert generation.log_probs == lps
    assert generation.status == status


@pytest.mark.parametrize(("answer", "message"), [
    ({"choices": []}, "without tokens"),
    ({"choices": [{"finish_reason": "length", "logprobs": {"tokens": ["token_id:x"],
                                                           "token_logprobs": [-1.0]}}]},
     "without tokens"),
    (vllm_answer([1], [float("nan")], "length"), "not a finite number"),
    (vllm_answer([1], [-1.0], "tool_calls"), "unknown finish_reason 'tool_calls'"),
])
def test_vllm_answers_without_usable_tokens_are_one_line_errors(answer, message):
    with pytest.raises(EngineError, match=message):
        parse_vllm_completion(answer)


def test_sglang_body_has_input_ids_sampling_params_logprobs_and_rid():
    body = sglang_generate_body([5, 6, 41], SAMPLING, "rid-7")
    assert body == {
        "input_ids": [5, 6, 41],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5},
        "return_logprob": True,
        "rid": "rid-7",
    }


@pytest.mark.parametrize(("finish_reason", "status"), [
    ({"type": "stop", "matched": 2}, "completed"),
    ({"type": "length", "length": 3}, "truncated"),
    ({"type": "abort", "message": "Abort before prefill", "status_code": None,
      "err_type": None}, "aborted"),
])
def test_sglang_answer_reads_meta_info_output_token_logprobs(finish_reason, status):
    answer = {
        "text": " Paris.",
        "output_ids": [12366, 13, 2],
        "meta_info": {
            "id": "rid-7", "finish_reason": finish_reason, "prompt_tokens": 3,
            "completion_tokens": 3, "cached_tokens": 0, "weight_version": "4",
            "output_token_logprobs": [[-0.25, 12366, None], [-1.5, 13, None], [-0.01, 2, None]],
        },
    }
    generation = parse_sglang_generate(answer)
    assert generation.tokens == [12366, 13, 2]
    assert generation.log_probs == [-0.25, -1.5, -0.01]
    assert generation.status == status


def test_sglang_abort_before_any_token_has_no_tokens():
    answer = {"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort"},
                                        "output_token_logprobs": []}}
    generation = parse_sglang_generate(answer)
    assert (generation.tokens, generation.log_probs, generation.status) == ([], [], "aborted")


def test_sglang_answer_without_finish_reason_is_an_error():
    with pytest.raises(EngineError, match="without meta_info"):
        parse_sglang_generate({"text": "x", "meta_info": {"output_token_logprobs": []}})


def test_sglang_weight_version_is_sent_as_a_string():
    assert sglang_weights_body("/w/step-3", 3) == {"model_path": "/w/step-3",
                                                   "weight_version": "3"}
