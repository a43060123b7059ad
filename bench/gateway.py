"""Gateway ingest and prompt-serving benchmark against a real broker, lake and server.

    .venv/bin/python bench/gateway.py [--requests N] [--prompt-seconds 10] [--skip-ingest]

1. Events/s and p99 latency of `POST /v1/events` with batches of 1, 16 and 256 realistic
   samples (512 prompt + 1024 response tokens with log-probs), side by side with
   publishing the same events through the SDK (`RolloutPublisher.publish` + `flush` per
   batch, the SDK's own ack-per-batch equivalent). One sequential client each, so the
   ratio compares the paths, not the parallelism.
2. `POST /v1/runs/{run}/prompts?count=1` (default `step`) from 100 concurrent clients on
   keep-alive connections, in two modes printed side by side:
   (a) paced: each client sends on a fixed schedule (think time between requests) so the
       aggregate rate is `--prompt-rate` (200 req/s), below saturation. Latency counts
       from the *scheduled* send time, so a late send (the client still waiting for its
       previous answer) is charged to the server, not hidden (no coordinated omission).
   (b) closed loop: every client sends its next request as soon as the previous one is
       answered; this measures saturation throughput, and its latency is queueing
       (Little's law: latency = clients / throughput).
   The load generator is a minimal asyncio HTTP/1.1 client, so its own CPU stays small
   next to the server's (they share the machine, with the broker).

The gateway runs as `rolloutlake gateway` in its own process, as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scratch import scratch_folder  # noqa: E402

from ingest.io.broker import EmbeddedBroker, free_port  # noqa: E402
from ingest.io.kafka import KafkaSettings  # noqa: E402
from ingest.sdk.publisher import RolloutPublisher  # noqa: E402
from schemas.events import parse_event  # noqa: E402

BATCHES = (1, 16, 256)
RNG = np.random.default_rng(0)


def sample(run_id: str, group_index: int, rollout_id: int) -> dict:
    return {
        "event_id": uuid.uuid4().hex, "type": "sample_finished", "schema_version": 1,
        "run_id": run_id, "group_index": group_index, "rollout_id": rollout_id,
        "status": "completed", "prompt_tokens": RNG.integers(0, 150_000, 512).tolist(),
        "response_tokens": RNG.integers(0, 150_000, 1024).tolist(),
        "rollout_log_probs": np.round(-RNG.random(1024), 4).tolist(), "reward": 1.0,
    }


def batches(size: int, count: int) -> list[list[dict]]:
    run_id = f"bench-{uuid.uuid4().hex[:6]}"
    return [[sample(run_id, b, i) for i in range(size)] for b in range(count)]


def summarize(latencies: list[float], events: int, elapsed: float) -> tuple[float, float]:
    return events / elapsed, float(np.percentile(latencies, 99) * 1000)


def bench_sdk(kafka: KafkaSettings, work: list[list[dict]]) -> tuple[float, float]:
    latencies = []
    with RolloutPublisher(kafka) as pub:
        start = time.perf_counter()
        for batch in work:
            t = time.perf_counter()
            for event in batch:
                pub.publish(parse_event(event))
            pub.flush()
            latencies.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    return summarize(latencies, sum(map(len, work)), elapsed)


def bench_gateway(url: str, work: list[list[dict]]) -> tuple[float, float]:
    latencies = []
    bodies = [orjson.dumps(batch) for batch in work]  # client-side encoding is not timed
    with httpx.Client(base_url=url, timeout=60) as client:
        start = time.perf_counter()
        for body in bodies:
            t = time.perf_counter()
            response = client.post("/v1/events", content=body,
                                   headers={"Content-Type": "application/json"})
            latencies.append(time.perf_counter() - t)
            response.raise_for_status()
        elapsed = time.perf_counter() - start
    return summarize(latencies, sum(map(len, work)), elapsed)


class _Connection:
    """One keep-alive HTTP/1.1 connection that POSTs without a body (a few µs per request,
    unlike a full client library, so the generator does not eat the server's CPU)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, host)

    async def post(self, path: str) -> tuple[int, bytes]:
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                          "Content-Length: 0\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def bench_prompts(url: str, run_id: str, concurrency: int, seconds: float,
                        rate: float | None) -> dict[str, float]:
    """`concurrency` clients for `seconds`: paced at `rate` req/s in all, or closed loop."""
    host, port = url.removeprefix("http://").split(":")
    path = f"/v1/runs/{run_id}/prompts?count=1"
    conns = [await _Connection.open(host, int(port)) for _ in range(concurrency)]
    for conn in conns:  # warm every connection (and the run's cursor) before timing
        assert (await conn.post(path))[0] == 200
    latencies: list[float] = []
    errors = 0
    # The generator's own GC pauses would be charged to the server (see the paced clock).
    gc.collect()
    gc.freeze()
    gc.disable()
    start = time.perf_counter() + 0.1
    stop = start + seconds

    async def client(k: int, conn: _Connection) -> None:
        nonlocal errors
        period = concurrency / rate if rate else 0.0
        due = start + k * period / concurrency
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent = due if rate else time.perf_counter()
            status, _ = await conn.post(path)
            latencies.append(time.perf_counter() - sent)
            errors += status != 200
            due = due + period if rate else time.perf_counter()

    await asyncio.gather(*(client(k, conn) for k, conn in enumerate(conns)))
    elapsed = time.perf_counter() - start
    gc.enable()
    for conn in conns:
        conn.close()
    ms = np.array(latencies) * 1000
    return {"requests": len(ms), "rate": len(ms) / elapsed, "p50": np.percentile(ms, 50),
            "p99": np.percentile(ms, 99), "max": ms.max(), "errors": errors}


def wait_ready(url: str, process: subprocess.Popen) -> None:
    for _ in range(300):
        if process.poll() is not None:
            raise SystemExit(f"gateway exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz").json()["kafka"] == "connected":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("gateway did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=0,
                        help="batches per case (default: about 2,000 events per case)")
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--prompt-seconds", type=float, default=10.0,
                        help="duration of each prompt-serving mode")
    parser.add_argument("--prompt-rate", type=float, default=200.0,
                        help="aggregate request rate of the paced mode (req/s)")
    parser.add_argument("--skip-ingest", action="store_true",
                        help="only the prompt-serving part")
    args = parser.parse_args()
    root = scratch_folder("gateway-bench-")
    with EmbeddedBroker(free_port()) as broker:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="bench.")
        kafka.ensure_topics()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = subprocess.Popen(
            [sys.executable, "-m", "ingest.cli", "gateway", "--allow-anonymous",
             "--port", str(port), "--bootstrap-servers", kafka.bootstrap_servers,
             "--topic-prefix", "bench.", "--lake", str(root / "lake"),
             "--state-dir", str(root / "state")],
            stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            wait_ready(url, gateway)
            print(f"{'batch':>6} | {'SDK ev/s':>9} {'SDK p99 ms':>10} | "
                  f"{'GW ev/s':>9} {'GW p99 ms':>10} | {'GW/SDK':>6}")
            for size in () if args.skip_ingest else BATCHES:
                count = args.requests or max(8, 2048 // size)
                sdk = bench_sdk(kafka, batches(size, count))
                gw = bench_gateway(url, batches(size, count))
                print(f"{size:>6} | {sdk[0]:>9.0f} {sdk[1]:>10.1f} | {gw[0]:>9.0f} "
                      f"{gw[1]:>10.1f} | {gw[0] / sdk[0]:>6.2f}")
            body = b"".join(orjson.dumps({"input": f"prompt {i}"}) + b"\n" for i in range(10_000))
            httpx.post(f"{url}/v1/datasets/bench", params={"filename": "b.jsonl"},
                       content=body, timeout=60).raise_for_status()
            run_id = f"bench-{uuid.uuid4().hex[:6]}"
            httpx.post(f"{url}/v1/runs", json={"run_id": run_id, "dataset": "bench", "config": {
                "n_samples_per_prompt": 8, "rollout_batch_size": 32}}).raise_for_status()
            modes = [(f"(a) paced {args.prompt_rate:.0f} req/s", args.prompt_rate),
                     ("(b) closed loop", None)]
            print(f"\nprompts, count=1, {args.concurrency} clients, {args.prompt_seconds:.0f} s "
                  "per mode")
            print(f"{'mode':<22} | {'requests':>8} {'req/s':>7} | {'p50 ms':>7} {'p99 ms':>7} "
                  f"{'max ms':>7} | {'errors':>6}")
            for name, rate in modes:
                r = asyncio.run(bench_prompts(url, run_id, args.concurrency,
                                              args.prompt_seconds, rate))
                print(f"{name:<22} | {r['requests']:>8} {r['rate']:>7.0f} | {r['p50']:>7.1f} "
                      f"{r['p99']:>7.1f} {r['max']:>7.1f} | {r['errors']:>6}")
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)


if __name__ == "__main__":
    main()
