"""The engine adapters' HTTP connections against a real uvicorn server (what vLLM and
SGLang serve with)."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from ingest.io.broker import free_port
from ingest.workers.engines import KEEPALIVE_EXPIRY_S, SGLangEngine, VLLMEngine

UVICORN_KEEP_ALIVE_S = 5  # uvicorn's default timeout_keep_alive, which both engines keep


def test_an_idle_connection_is_dropped_before_the_engine_may_close_it():
    """uvicorn closes a connection idle for its keep-alive timeout. A client that keeps it
    as long (httpx's default is the same 5 s) can send a request on it as it closes: a
    `ReadError`, and a sample published as `engine_error` (seen under load in CI). The
    adapters open a new connection once one was idle for less than that."""
    assert KEEPALIVE_EXPIRY_S < UVICORN_KEEP_ALIVE_S
    client_ports: list[int] = []

    async def health(request: Request) -> PlainTextResponse:
        assert request.client is not None
        client_ports.append(request.client.port)
        return PlainTextResponse("ok")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[Route("/health", health)]), host="127.0.0.1", port=port,
        log_config=None, access_log=False, timeout_keep_alive=UVICORN_KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)

    async def probe(engine: VLLMEngine | SGLangEngine) -> list[bool]:
        answers = [await engine.health(), await engine.health()]  # back to back: one connection
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle, still short of uvicorn's 5 s
        answers.append(await engine.health())
        await engine.aclose()
        return answers

    try:
        for engine_class in (VLLMEngine, SGLangEngine):
            client_ports.clear()
            assert asyncio.run(probe(engine_class(f"http://127.0.0.1:{port}"))) == [True] * 3
            first, again, after_idle = client_ports
            assert first == again, "back-to-back requests should share a connection"
            assert after_idle != first, (
                f"{engine_class.__name__} reused a connection idle for "
                f"{KEEPALIVE_EXPIRY_S + 0.5:g} s")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
