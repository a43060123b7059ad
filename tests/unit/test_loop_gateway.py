"""What the loop gives its gateway: the run config its worker's flags describe, and tokens
the gateway only knows by hash."""

from __future__ import annotations

import json
import stat
import sys

from gateway.auth import TokenStore
from gateway.config import TOKENS_ENV, load_config
from ingest.commands.loop import (
    GATEWAY_TOKENS,
    RUN_ID,
    LoopConfig,
    _Child,
    run_config,
    worker_command,
    write_gateway_tokens,
)
from ingest.io.kafka import KafkaSettings

KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9092", topic_prefix="t.")


def test_the_registered_run_has_the_config_of_the_workers_flags(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # the worker's config checks it exists
    config = LoopConfig(groups=4, n_samples=6, over_sampling=12, std_normalization=False,
                        dynamic_sampling_filter_path="ingest.core.filters.reward_nonzero_std")
    command = worker_command(config, KAFKA, "http://127.0.0.1:8000", tmp_path,
                             "http://127.0.0.1:8080", tmp_path / "worker.token")
    assert run_config(command) == {
        "n_samples_per_prompt": 6, "rollout_batch_size": 4, "over_sampling_batch_size": 12,
        "dynamic_sampling_filter_path": "ingest.core.filters.reward_nonzero_std",
        "reward_key": None, "std_normalization": False, "partial_rollout": False, "max_staleness": 0,
        "rollout_shuffle": False}


def test_gateway_tokens_are_owner_only_files_and_the_gateway_gets_their_hashes(tmp_path):
    tokens_file = write_gateway_tokens(tmp_path)
    specs = json.loads(tokens_file.read_text())
    store = TokenStore(load_config({"tokens_file": tokens_file}, env={}))
    tokens = {}
    for holder in GATEWAY_TOKENS:
        path = tmp_path / f"{holder}.token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        tokens[holder] = path.read_text().strip()
        assert tokens[holder] not in tokens_file.read_text()
    assert len(set(tokens.values())) == len(GATEWAY_TOKENS)
    assert {spec["name"] for spec in specs} == set(GATEWAY_TOKENS)

    loop, worker, dashboard = (store.authenticate(tokens[h])
                               for h in ("loop", "worker", "dashboard"))
    assert loop is not None and loop.allows("write") and loop.runs is None  # uploads datasets
    assert worker is not None and worker.allows("write", RUN_ID)
    assert not worker.allows("write", "another-run")
    assert dashboard is not None and dashboard.allows("read", RUN_ID)
    assert not dashboard.allows("write", RUN_ID)

    # A second run in the same folder replaces every token.
    write_gateway_tokens(tmp_path)
    assert all((tmp_path / f"{h}.token").read_text().strip() != tokens[h]
               for h in GATEWAY_TOKENS)


def test_the_loops_commands_do_not_inherit_gateway_tokens_from_the_environment(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv(TOKENS_ENV, '[{"name": "outsider", "sha256": "00", "scopes": ["write"]}]')
    child = _Child("env", [sys.executable, "-c",
                           f"import os; print(os.environ.get({TOKENS_ENV!r}, 'unset'))"],
                   tmp_path / "env.log")
    child.process.wait(timeout=30)
    child.stop()
    assert (tmp_path / "env.log").read_text().strip() == "unset"
