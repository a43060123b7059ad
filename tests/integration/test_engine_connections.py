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
from ingest.workers.engines import (
    KEEPALIVE_EXPIRY_S,
    EngineError,
    Generation,
    Sampling,
    SGLangEngine,
    VLLMEngine,
)

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


class ClosingServer:
    """An HTTP/1.1 peer on loopback that reads each request and, for the first
    `closes` connections, closes it without an answer; later ones get a vLLM completion."""

    ANSWER = (b'{"choices": [{"text": "", "finish_reason": "stop", "logprobs": {'
              b'"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}]}')

    def __init__(self, closes: int):
        self.closes = closes
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        self.requests += 1
        if self.requests <= self.closes:
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(self.ANSWER), self.ANSWER))
        await writer.drain()
        writer.close()


async def _generate_against(peer: ClosingServer) -> object:
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = VLLMEngine(f"http://127.0.0.1:{port}")
    try:
        return await engine.generate([1, 2], Sampling(max_new_tokens=4), "r0")
    except EngineError as err:
        return err
    finally:
        await engine.aclose()
        server.close()


def test_a_request_the_engine_closed_without_answering_is_sent_once_more():
    peer = ClosingServer(closes=1)
    generation = asyncio.run(_generate_against(peer))
    assert isinstance(generation, Generation), generation
    assert (generation.tokens, peer.requests) == ([7], 2)


def test_an_engine_that_closes_again_is_an_engine_error_after_the_second_try():
    peer = ClosingServer(closes=2)
    error = asyncio.run(_generate_against(peer))
    assert isinstance(error, EngineError)
    assert str(error).startswith("vLLM at http://127.0.0.1:") and \
        "/v1/completions: RemoteProtocolError: Server disconnected without sending a response" \
        in str(error), str(error)
    assert peer.requests == 2
