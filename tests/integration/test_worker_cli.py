"""`rolloutlake engine` and `rolloutlake worker` refuse bad input with one line and exit 2.

No engine is started here: each case fails before one would be needed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.io.broker import free_port
from trainer.tiny import tiny_tokenizer

pytestmark = pytest.mark.one_broker(
    "each case is refused before the command publishes anything")

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ingest.cli"]
REWARD_PATH = "tests.support.user_rewards.digit_share_or_raise"


def refused(*args: str) -> str:
    """Run the command, expect exit 2 and one error line, no traceback; return that line.
    (Log lines of the command's start, such as the worker's resolved config, may precede it.)"""
    done = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in lines if line.startswith("rolloutlake ")]
    assert errors == lines[-1:], done.stderr[-2000:]
    return lines[-1]


def test_engine_without_its_venv_names_the_install_command(tmp_path):
    line = refused("engine", "--venv", str(tmp_path / "missing"), "--port", str(free_port()))
    assert line == (f"rolloutlake engine: no inference engine venv at {tmp_path / 'missing'}: "
                    f"install it with `make engine` (or `sh deploy/engine/install.sh "
                    f"{tmp_path / 'missing'}`)")


def test_sglang_engine_without_its_venv_names_the_install_script(tmp_path):
    missing = tmp_path / "no-sglang"
    line = refused("engine", "--backend", "sglang", "--sglang-venv", str(missing),
                   "--port", str(free_port()))
    assert line == (f"rolloutlake engine: no SGLang venv at {missing}: install it on a CUDA "
                    f"machine with `sh deploy/engine/install-sglang.sh {missing}` "
                    "(or `make test-gpu`)")


def test_engine_on_a_taken_port_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused("engine", "--port", str(port), "--venv", str(ROOT / ".venv-engine"))
    assert line == (f"rolloutlake engine: port {port} on 127.0.0.1 is already in use; "
                    "pick another with --port")


def test_engine_model_must_be_tiny_or_a_model_folder(tmp_path):
    line = refused("engine", "--model", str(tmp_path))
    assert line == (f"rolloutlake engine: --model: '{tmp_path}' is neither 'tiny' nor a "
                    "model folder with config.json")


@pytest.fixture
def worker_inputs(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer_dir)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"input": "1+1=", "label": "2"}) + "\n")
    return tokenizer_dir, dataset


def worker_args(kafka, tokenizer_dir: Path, dataset: Path, *extra: str) -> list[str]:
    return ["worker", "--run", "bad-input", "--prompt-data", str(dataset), "--label-key",
            "label", "--tokenizer", str(tokenizer_dir), "--custom-rm-path", REWARD_PATH,
            "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix",
            kafka.topic_prefix, *extra]


def test_worker_without_an_engine_names_the_url(kafka, worker_inputs):
    port = free_port()
    line = refused(*worker_args(kafka, *worker_inputs,
                                "--engine-url", f"http://127.0.0.1:{port}"))
    assert line == (f"rolloutlake worker: no engine answers at http://127.0.0.1:{port}/health; "
                    "start one with `rolloutlake engine` or fix --engine-url")


@pytest.mark.parametrize(("change", "expected"), [
    (("--custom-rm-path", "no_such_module.rm"),
     "rolloutlake worker: --custom-rm-path: reward function path 'no_such_module.rm': cannot "
     "import module 'no_such_module': No module named 'no_such_module'"),
    (("--custom-rm-path", "tests.support.user_rewards.no_such_rm"),
     "rolloutlake worker: --custom-rm-path: reward function path "
     "'tests.support.user_rewards.no_such_rm': module 'tests.support.user_rewards' has "
     "no attribute 'no_such_rm'"),
    (("--custom-rm-path", "tests.support.user_rewards_broken.rm"),
     "rolloutlake worker: --custom-rm-path: reward function path "
     "'tests.support.user_rewards_broken.rm': importing module "
     "'tests.support.user_rewards_broken' raised RuntimeError: this reward module is broken"),
    (("--custom-rm-path", "rm"),
     "rolloutlake worker: --custom-rm-path: 'rm' is not of the form 'module.function' or "
     "'module:function'"),
    (("--event-partitions", "0"),
     "rolloutlake worker: --event-partitions: Input should be greater than or equal to 1"),
    (("--rollout-batch-size", "4", "--over-sampling-batch-size", "2"),
     "rolloutlake worker: --over-sampling-batch-size: must be >= --rollout-batch-size (4), "
     "got 2"),
    (("--engine", "sglang", "--seed", "3"),
     "rolloutlake worker: --seed: the SGLang adapter sends no per-request seed; unset --seed"),
    (("--max-staleness", "-1"),
     "rolloutlake worker: --max-staleness: Input should be greater than or equal to 0"),
    (("--n-samples-per-prompt", "0"),
     "rolloutlake worker: --n-samples-per-prompt: Input should be greater than or equal to 1"),
    (("--prompts-from", "http://127.0.0.1:1"),
     "rolloutlake worker: give exactly one of --prompt-data and --prompts-from"),
    (("--num-workers", "2", "--worker-index", "2"),
     "rolloutlake worker: --worker-index 2 is not below --num-workers 2"),
    (("--rollout-batch-size", "2", "--num-workers", "3"),
     "rolloutlake worker: --num-workers 3 is more than the groups of a round (2, "
     "--over-sampling-batch-size): a worker would never get one"),
    (("--partial-rollout",),
     "rolloutlake worker: --partial-rollout needs --prompts-from: the gateway keeps the "
     "recycled samples durable"),
    (("--mask-offpolicy-in-partial-rollout",),
     "rolloutlake worker: --mask-offpolicy-in-partial-rollout needs --partial-rollout"),
    (("--max-over-sampling-rounds", "0"),
     "rolloutlake worker: --max-over-sampling-rounds: Input should be greater than or equal "
     "to 1"),
])
def test_worker_flag_errors_name_the_flag(kafka, worker_inputs, change, expected):
    assert refused(*worker_args(kafka, *worker_inputs, *change)) == expected


def test_worker_tokenizer_must_be_a_tokenizer_folder(kafka, worker_inputs, tmp_path):
    _, dataset = worker_inputs
    line = refused(*worker_args(kafka, tmp_path, dataset))
    assert line == (f"rolloutlake worker: --tokenizer: {tmp_path} holds no Hugging Face "
                    "tokenizer (tokenizer.json)")


@pytest.mark.parametrize(("lines", "expected"), [
    ('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": \n',
     "line 2: not valid JSON"),
    ('{"input": "1+1="}\n', "line 1: missing label key 'label'"),
    ('{"input": [{"role": "user", "content": "1+1="}], "label": "2"}\n',
     "line 1: the worker takes string prompts; 'input' holds chat messages"),
    ("\n\n", "holds no prompts"),
])
def test_worker_bad_dataset_lines_are_named(kafka, worker_inputs, tmp_path, lines, expected):
    tokenizer_dir, _ = worker_inputs
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text(lines)
    line = refused(*worker_args(kafka, tokenizer_dir, dataset))
    assert line.startswith(f"rolloutlake worker: --prompt-data: {dataset}")
    assert expected in line
