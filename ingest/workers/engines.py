"""Inference engines over HTTP: one interface, a vLLM and an SGLang implementation.

Each implementation is a pair of pure mappings (request body out, `Generation` in), which
the unit tests drive with bodies from the engines' own source, and a thin async httpx
shell. One request is one sample with its own request id, so a single sample can be
aborted (an n>1 request cannot). A router forwards neither aborts nor weight calls, so
callers send those to every engine themselves.
"""

from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from schemas.errors import RolloutlakeError

log = logging.getLogger(__name__)

FinishStatus = Literal["completed", "truncated", "aborted"]
EngineKind = Literal["vllm", "sglang"]
FLUSH_RETRIES = 120
FLUSH_RETRY_S = 0.5


class EngineError(RolloutlakeError):
    """The engine could not be started or reached, or answered something unusable."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    ignore_eos: bool = False  # sent only when set, so default bodies stay the engines' own
    seed: int | None = None  # per request; sent only when set (vLLM)


@dataclass(frozen=True)
class Generation:
    """One sample's response tokens, their log-probs under the engine's weights, and why
    generation ended (an aborted one keeps the tokens it had)."""

    tokens: list[int]
    log_probs: list[float]
    status: FinishStatus


def _status(reason: str | None, engine: str) -> FinishStatus:
    statuses: dict[str | None, FinishStatus] = {
        "stop": "completed", "length": "truncated", "abort": "aborted"}
    if reason not in statuses:
        raise EngineError(f"{engine} finished with an unknown finish_reason {reason!r}")
    return statuses[reason]


def _finite(log_probs: list[Any], engine: str) -> list[float]:
    values = [float(v) for v in log_probs]
    if not all(math.isfinite(v) for v in values):
        raise EngineError(f"{engine} returned a log-prob that is not a finite number")
    return values


# -- vLLM (OpenAI-compatible completions) ---------------------------------------------

def vllm_request_id(request_id: str) -> str:
    """The id vLLM's engine knows a completion by: `cmpl-<request_id>-<prompt index>`."""
    return f"cmpl-{request_id}-0"


def vllm_completion_body(prompt_tokens: list[int], sampling: Sampling,
                         request_id: str) -> dict[str, Any]:
    return {
        "prompt": list(prompt_tokens),
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "logprobs": 0,  # the sampled token's log-prob only
        "return_tokens_as_token_ids": True,
        "request_id": request_id,
        **({"ignore_eos": True} if sampling.ignore_eos else {}),
        **({"seed": sampling.seed} if sampling.seed is not None else {}),
    }


def parse_vllm_completion(body: dict[str, Any]) -> Generation:
    try:
        choice = body["choices"][0]
        logprobs = choice["logprobs"] or {"tokens": [], "token_logprobs": []}
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        log_probs = _finite(logprobs["token_logprobs"], "vLLM")
        reason = choice["finish_reason"]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise EngineError(f"vLLM answered a completion without tokens and log-probs ({err!r})"
                          ) from None
    if len(tokens) != len(log_probs):
        raise EngineError("vLLM returned a different number of tokens and log-probs")
    return Generation(tokens, log_probs, _status(reason, "vLLM"))


# -- SGLang (native /generate) ---------------------------------------------------------

def sglang_generate_body(prompt_tokens: list[int], sampling: Sampling,
                         request_id: str) -> dict[str, Any]:
    return {
        "input_ids": list(prompt_tokens),
        "sampling_params": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
            **({"ignore_eos": True} if sampling.ignore_eos else {}),
        },
        "return_logprob": True,
        "rid": request_id,
    }


def parse_sglang_generate(body: dict[str, Any]) -> Generation:
    try:
        meta = body["meta_info"]
        items = meta.get("output_token_logprobs") or []
        tokens = [int(item[1]) for item in items]  # [logprob, token_id, text]
        log_probs = _finite([item[0] for item in items], "SGLang")
        reason = meta["finish_reason"]["type"]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise EngineError(f"SGLang answered /generate without meta_info tokens ({err!r})"
                          ) from None
    return Generation(tokens, log_probs, _status(reason, "SGLang"))


def sglang_weights_body(path: str, weight_version: int) -> dict[str, Any]:
    return {"model_path": path, "weight_version": str(weight_version)}


# -- the interface and its HTTP shells ---------------------------------------------------

# Both engines serve through uvicorn, which closes a connection idle for 5 s (its
# timeout_keep_alive). httpx keeps idle connections as long by default, so a request sent
# on one as the server closes it fails with ReadError; dropping them sooner avoids that.
KEEPALIVE_EXPIRY_S = 2.0


class Engine(ABC):
    """One engine server at `url`; every call raises `EngineError` when it fails."""

    name = "engine"

    def __init__(self, url: str, *, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(  # httpx's default pool sizes, a shorter expiry
            base_url=self.url, timeout=timeout_s,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S))

    @abstractmethod
    async def generate(self, prompt_tokens: list[int], sampling: Sampling,
                       request_id: str) -> Generation: ...

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def reload_weights(self, path: str, weight_version: int) -> None:
        """Load HF weights from `path` in place: pause, load, resume."""

    async def health(self) -> bool:
        try:
            return (await self._client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, path: str, body: dict[str, Any] | None = None, *,
                    params: dict[str, str] | None = None) -> httpx.Response:
        try:
            try:
                response = await self._client.post(path, json=body, params=params)
            except (httpx.ReadError, httpx.RemoteProtocolError) as err:
                # Closed without an answer: most often a pooled connection the engine was
                # closing as the request went out, which it then never read (seen under
                # load, where a frozen client outlives the server's keep-alive). Once
                # more, on a new connection; an engine that is gone fails that one too.
                log.info("%s at %s%s closed the connection without answering (%s: %s); "
                         "sending it again", self.name, self.url, path, type(err).__name__, err)
                response = await self._client.post(path, json=body, params=params)
        except httpx.HTTPError as err:
            raise EngineError(f"{self.name} at {self.url}{path}: {type(err).__name__}: {err}"
                              ) from None
        if response.status_code >= 400:
            raise EngineError(f"{self.name} at {self.url}{path} answered "
                              f"{response.status_code}: {response.text[:200]}")
        return response


class VLLMEngine(Engine):
    name = "vLLM"

    async def generate(self, prompt_tokens: list[int], sampling: Sampling,
                       request_id: str) -> Generation:
        body = vllm_completion_body(prompt_tokens, sampling, request_id)
        return parse_vllm_completion((await self._post("/v1/completions", body)).json())

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._post("/abort_requests",
                             {"request_ids": [vllm_request_id(r) for r in request_ids]})

    async def reload_weights(self, path: str, weight_version: int) -> None:
        # mode=wait: requests in flight finish under the old weights instead of aborting.
        await self._post("/pause", params={"mode": "wait"})
        try:
            await self._post("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": path}})
        finally:
            await self._post("/resume")


class SGLangEngine(Engine):
    name = "SGLang"

    async def generate(self, prompt_tokens: list[int], sampling: Sampling,
                       request_id: str) -> Generation:
        body = sglang_generate_body(prompt_tokens, sampling, request_id)
        return parse_sglang_generate((await self._post("/generate", body)).json())

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            await self._post("/abort_request", {"rid": request_id})

    async def reload_weights(self, path: str, weight_version: int) -> None:
        await self._post("/pause_generation", {})
        try:
            await self._flush_cache()
            answer = (await self._post("/update_weights_from_disk",
                                       sglang_weights_body(path, weight_version))).json()
            if not answer.get("success", False):
                raise EngineError(f"SGLang could not load weights from {path}: "
                                  f"{answer.get('message', answer)}")
        finally:
            await self._post("/continue_generation", {})

    async def _flush_cache(self) -> None:
        """SGLang refuses to flush while requests still hold cache; it frees them soon."""
        for _ in range(FLUSH_RETRIES):
            try:
                response = await self._client.post("/flush_cache")
            except httpx.HTTPError as err:
                raise EngineError(f"SGLang at {self.url}/flush_cache: {err}") from None
            if response.status_code == 200:
                return
            await asyncio.sleep(FLUSH_RETRY_S)
        raise EngineError(f"SGLang at {self.url} did not flush its cache within "
                          f"{FLUSH_RETRIES * FLUSH_RETRY_S:.0f} s")


def make_engine(kind: EngineKind, url: str, *, timeout_s: float = 600.0) -> Engine:
    engines: dict[str, type[Engine]] = {"vllm": VLLMEngine, "sglang": SGLangEngine}
    return engines[kind](url, timeout_s=timeout_s)
