"""A `RolloutWorker` driven in process against an engine of the test's own (one that
pauses like vLLM, or drops answers), publishing through a real broker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ingest.core.dataset_rows import DatasetOptions
from ingest.io.kafka import KafkaSettings
from ingest.sdk.publisher import RolloutPublisher
from ingest.workers.config import WorkerConfig
from ingest.workers.engines import Engine
from ingest.workers.prompts import DatasetPrompts, load_prompts
from ingest.workers.rollout import RolloutWorker
from schemas.dotted import load_callable
from tests.support.engine_server import write_dataset
from trainer.tiny import tiny_tokenizer


def run_in_process(kafka: KafkaSettings, tmp_path: Path, run_id: str, engine: Engine,
                   drive: Callable[[RolloutWorker], Awaitable[None]], *,
                   timeout_s: float = 120.0, **fields: Any) -> None:
    """Run a worker of `run_id` on `engine` (one prompt, `fields` over small defaults) to
    its end, while `drive(worker)` runs beside it on the same loop; both within
    `timeout_s`, else TimeoutError."""
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tokenizer_dir)
    config = WorkerConfig(**{
        "run": run_id, "prompt_data": write_dataset(tmp_path / "prompts.jsonl",
                                                    [{"input": "1+1=", "label": "2"}]),
        "tokenizer": tokenizer_dir, "label_key": "label",
        "custom_rm_path": "tests.support.user_rewards.digit_share_or_raise", "kafka": kafka,
        "seal_wait_s": 0, **fields})
    assert config.prompt_data is not None
    prompts = load_prompts(config.prompt_data, DatasetOptions(label_key="label"), tokenizer)

    async def both() -> None:
        with RolloutPublisher(kafka, producer_id=f"worker-{run_id}") as publisher:
            worker = RolloutWorker(config, publisher=publisher, engines=[engine],
                                   tokenizer=tokenizer,
                                   reward_fn=load_callable(config.custom_rm_path, "reward"),
                                   prompts=DatasetPrompts(prompts))
            await asyncio.wait_for(asyncio.gather(worker.run(), drive(worker)), timeout_s)
        await engine.aclose()

    asyncio.run(both())
