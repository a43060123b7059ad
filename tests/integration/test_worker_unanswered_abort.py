"""A seal's abort that the engine never answers does not hold the worker: vLLM's CPU build
was seen to answer `/abort_requests` and then never answer the aborted completions, and
the worker waited for them until its HTTP timeout, its step never over. The engine here is
in process and drops those answers; the events go through a real broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from ingest.workers import rollout
from ingest.workers.engines import Engine, Generation, Sampling
from schemas.control import StepSealed
from tests.support.engine_server import published
from tests.support.in_process_worker import run_in_process

pytestmark = pytest.mark.one_broker("the worker's broker path is the SDK's")


class SilentAbortEngine(Engine):
    """Every request generates until it is aborted, and an aborted request never answers."""

    name = "silent-abort engine"

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")  # never called: every route is overridden
        self.in_flight: set[str] = set()
        self.aborted: list[str] = []

    async def health(self) -> bool:
        return True

    async def generate(self, prompt_tokens: list[int], sampling: Sampling,
                       request_id: str) -> Generation:
        self.in_flight.add(request_id)
        await asyncio.Event().wait()  # neither finishes nor answers its abort
        raise AssertionError("unreachable")

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def reload_weights(self, path: str, weight_version: int) -> None:
        raise AssertionError("no reload in this test")


def test_aborted_requests_that_never_answer_are_given_up_and_cancelled(
        kafka, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(rollout, "ABORT_ANSWER_S", 0.5)
    run_id = "silent-abort"
    engine = SilentAbortEngine()

    async def seal_once_generating(worker) -> None:
        while len(engine.in_flight) < 2:
            await asyncio.sleep(0.01)
        worker.on_control(StepSealed(run_id=run_id, step=0, sealed_at=time.time()))

    run_in_process(kafka, tmp_path, run_id, engine, seal_once_generating, timeout_s=30,
                   n_samples_per_prompt=2, rollout_batch_size=1, num_steps=1)
    assert sorted(engine.aborted) == sorted(engine.in_flight)
    aborted = [e for e in published(kafka, run_id) if e.type == "sample_aborted"]
    assert sorted(e.rollout_id for e in aborted) == [0, 1]
    assert {e.reason for e in aborted} == {"cancelled"}
    assert "2 aborted requests did not answer within 0.5 s" in caplog.text
