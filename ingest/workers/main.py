"""`rolloutlake worker`: flags, wiring and the run of one rollout worker.

    rolloutlake worker --run r1 --prompt-data prompts.jsonl --tokenizer artifacts/tiny-policy \
        --custom-rm-path my_rewards.exact_match --engine-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ingest.core.dataset_rows import DatasetOptions
from ingest.sdk.publisher import RolloutPublisher
from ingest.workers.config import WorkerConfig
from ingest.workers.control import ControlFollower
from ingest.workers.engines import EngineError, make_engine
from ingest.workers.prompts import DatasetPrompts, GatewayPrompts, PromptSource, load_prompts
from ingest.workers.rollout import Progress, RolloutWorker
from schemas.config import add_config_flags, config_from_args, setting_name
from schemas.dotted import load_callable
from schemas.errors import ConfigError, FilterLoadError, RolloutlakeError

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, WorkerConfig)


def load_tokenizer(config: WorkerConfig):
    from transformers import AutoTokenizer  # heavy: only once the flags are valid

    try:
        return AutoTokenizer.from_pretrained(str(config.tokenizer), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--tokenizer: cannot load {config.tokenizer}: {err}") from None


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    config = config_from_args(WorkerConfig, args)
    try:
        reward_fn = load_callable(config.custom_rm_path, "reward function")
    except FilterLoadError as err:
        raise ConfigError(f"{setting_name(WorkerConfig, ['custom_rm_path'])}: {err}") from None
    tokenizer = load_tokenizer(config)
    prompts: PromptSource
    if config.prompts_from is not None:
        prompts = GatewayPrompts(config.prompts_from, config.run, config.gateway_token(),
                                 tokenizer, config.n_samples_per_prompt)
    else:
        assert config.prompt_data is not None  # the config requires one of the two
        prompts = DatasetPrompts(load_prompts(config.prompt_data, DatasetOptions(
            input_key=config.input_key, label_key=config.label_key,
            metadata_key=config.metadata_key), tokenizer))
    log.info("worker config %s", config.model_dump_json())
    progress = asyncio.run(_run(config, reward_fn, tokenizer, prompts))
    print(f"worker done: {progress.groups_issued} groups, {progress.samples_finished} samples "
          f"finished, {progress.samples_aborted} aborted, {progress.samples_cancelled} "
          f"cancelled at seal, {progress.response_tokens} response tokens at "
          f"{progress.tokens_per_s:,.0f} tokens/s, {progress.extra_rounds} extra "
          f"over-sampling rounds ({progress.rounds_past_cap} past the cap)", flush=True)
    if progress.engine_errors:
        raise EngineError(f"{progress.engine_errors} samples got no answer from the engine, "
                          f"published as sample_aborted(engine_error) (last: "
                          f"{progress.last_engine_error})")
    return 0


async def _run(config: WorkerConfig, reward_fn, tokenizer, prompts: PromptSource) -> Progress:
    engines = [make_engine(config.engine, url, timeout_s=config.request_timeout_s)
               for url in config.engine_urls]
    settings = config.kafka
    follower: ControlFollower | None = None
    try:
        with RolloutPublisher(settings, producer_id=config.producer_id,
                              outage_grace_s=config.broker_outage_s) as publisher:
            worker = RolloutWorker(config, publisher=publisher, engines=engines,
                                   tokenizer=tokenizer, reward_fn=reward_fn, prompts=prompts,
                                   terminal=sys.stderr)
            loop = asyncio.get_running_loop()
            running = asyncio.ensure_future(worker.run())
            unfollowed: list[RolloutlakeError] = []

            def stop_unfollowed(error: RolloutlakeError) -> None:
                unfollowed.append(error)
                running.cancel()

            follower = ControlFollower(
                settings, config.run,
                lambda message: loop.call_soon_threadsafe(worker.on_control, message),
                lambda error: loop.call_soon_threadsafe(stop_unfollowed, error)).start()
            try:
                return await running
            except asyncio.CancelledError:
                if unfollowed:
                    raise unfollowed[0] from None
                raise
    finally:
        if follower is not None:
            follower.stop()
        for engine in engines:
            await engine.aclose()
        await prompts.aclose()
