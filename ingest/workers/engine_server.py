"""`rolloutlake engine`: an inference engine on loopback, from its own venv, tied to this process.

`--backend vllm` (the default) runs vLLM's CPU build; `--backend sglang` runs SGLang, which
needs a CUDA GPU. The engine runs under `engine_guard.py`, which ends the engine's whole
process tree when this process goes away, however it goes (also after a kill -9). Weight
reloads need vLLM's dev routes (`/pause`, `/collective_rpc`, `/resume`), so
`VLLM_SERVER_DEV_MODE=1`; SGLang serves its weight routes (`/update_weights_from_disk`)
without a switch.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import httpx

from ingest.io.broker import port_is_free
from ingest.workers.config import EngineServerConfig
from ingest.workers.engines import EngineError
from schemas.config import add_config_flags, config_from_args

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
GUARD = Path(__file__).with_name("engine_guard.py")


def engine_python(config: EngineServerConfig) -> Path:
    venv = config.sglang_venv if config.backend == "sglang" else config.venv
    python = venv.absolute() / "bin" / "python"  # not resolve(): the venv is the symlink
    if python.is_file():
        return python
    if config.backend == "sglang":
        raise EngineError(f"no SGLang venv at {venv}: install it on a CUDA machine with "
                          f"`sh deploy/engine/install-sglang.sh {venv}` (or `make test-gpu`)")
    raise EngineError(
        f"no inference engine venv at {venv}: install it with `make engine` "
        f"(or `sh deploy/engine/install.sh {venv}`)"
    )


def model_folder(config: EngineServerConfig) -> Path:
    if config.model != "tiny":
        return Path(config.model).resolve()
    from trainer.tiny import write_tiny_policy  # torch: only when the tiny policy is asked for

    return write_tiny_policy(config.tiny_dir).resolve()


class EngineServer:
    """An engine process; a context manager that waits until `/health` answers."""

    def __init__(self, config: EngineServerConfig):
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.model_dir: Path | None = None
        self.start_seconds: float | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.config.port}"

    def command(self, python: Path, model_dir: Path) -> list[str]:
        return [str(python), str(GUARD), "--", str(python), *self._engine_args(model_dir)]

    def _engine_args(self, model_dir: Path) -> list[str]:
        # float32 on both engines: the tests check the engine's log-probs against the same
        # weights in float32 torch within 2e-3, which bfloat16's 8-bit mantissa misses; a
        # tiny policy costs no memory either way.
        if self.config.backend == "vllm":
            return ["-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model_dir), "--skip-tokenizer-init", "--enforce-eager",
                    "--dtype", "float32", "--max-model-len", str(self.config.max_model_len),
                    "--host", HOST, "--port", str(self.config.port)]
        # Flags as SGLang documents them (docs.sglang.io/advanced_features/server_arguments,
        # `python -m sglang.launch_server --help`; sgl-project/sglang
        # docs/backend/server_arguments.md): --skip-tokenizer-init, so /generate takes and
        # returns token ids; --context-length caps prompt + response as vLLM's
        # --max-model-len does. FlashInfer, SGLang's default attention and sampling on CUDA,
        # has no float32 kernels, so attention is `torch_native` (PyTorch operations only,
        # sgl-project/sglang#2241) and sampling `pytorch`, the pair SGLang's own tests pass
        # as `--attention-backend torch_native --sampling-backend pytorch`; CUDA graphs are
        # off as vLLM's are (--enforce-eager): a quicker start for a policy this small.
        return ["-m", "sglang.launch_server",
                "--model-path", str(model_dir), "--skip-tokenizer-init",
                "--dtype", "float32", "--context-length", str(self.config.max_model_len),
                "--mem-fraction-static", str(self.config.mem_fraction_static),
                "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--disable-cuda-graph", "--host", HOST, "--port", str(self.config.port)]

    def start(self) -> EngineServer:
        python = engine_python(self.config)
        if not port_is_free(HOST, self.config.port):
            raise EngineError(
                f"port {self.config.port} on {HOST} is already in use; pick another with --port"
            )
        self.model_dir = model_folder(self.config)
        env = dict(os.environ)
        if self.config.backend == "vllm":
            env |= {"VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib),
                    "VLLM_SERVER_DEV_MODE": "1"}
        if self.config.log_file is not None:
            self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.config.log_file.open("ab")
        began = time.monotonic()
        # stdin is a pipe nobody writes to: the guard sees its end when this process ends.
        self.process = subprocess.Popen(
            self.command(python, self.model_dir), stdin=subprocess.PIPE, stdout=self._log,
            stderr=self._log, env=env,
        )
        self._wait_healthy(began + self.config.ready_timeout_s)
        self.start_seconds = time.monotonic() - began
        log.info("engine ready at %s in %.1f s (model %s)", self.url, self.start_seconds,
                 self.model_dir)
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.process is not None
        where = f" (see {self.config.log_file})" if self.config.log_file else ""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    self.stop()
                    raise EngineError(f"the engine exited with code {code} while starting{where}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise EngineError(
            f"the engine did not answer {self.url}/health within "
            f"{self.config.ready_timeout_s:.0f} s{where}; raise --ready-timeout-s"
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the guard ends the engine's group
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, EngineServerConfig)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    server = EngineServer(config_from_args(EngineServerConfig, args)).start()
    print(f"engine ready at {server.url} in {server.start_seconds:.0f} s "
          f"(model {server.model_dir}; Ctrl-C stops it)", flush=True)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    assert server.process is not None
    while not stopping and server.process.poll() is None:
        time.sleep(0.2)
    code = server.process.poll()
    server.stop()
    if not stopping:
        raise EngineError(f"the engine exited unexpectedly with code {code}")
    print("engine stopped", flush=True)
    return 0
