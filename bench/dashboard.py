"""Dashboard and metric stream performance on a 10,000-step run, printed as figures.

1. Headless Chromium opens the dashboard of a run with 10,000 sealed steps: time until
   every step is drawn, then the time from a step's `steps` commit to the page showing
   it (poll + read + stream + redraw) and the page's own redraw time per update.
2. 100 concurrent viewers stream the same run: each must receive every newly sealed step
   once and in order; prints the delivery latency from commit to receipt, and how long
   100 viewers take to replay the whole 10,000-step history at once.

Runs the real gateway (`create_app`) on the embedded broker over a lake in a temp folder.
Usage: python bench/dashboard.py [--steps 10000] [--viewers 100]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.io.broker import EmbeddedBroker, free_port  # noqa: E402
from ingest.io.kafka import KafkaSettings  # noqa: E402
from ingest.io.lake import Lake  # noqa: E402
from tests.support.metric_fixtures import READER_TOKEN, gateway, write_steps  # noqa: E402

RUN = "bench-10k"
AUTH = {"Authorization": f"Bearer {READER_TOKEN}"}
COMMIT_STEPS = 100  # steps per commit while building the run (10,000 single commits take long)


def build_run(lake: Lake, steps: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, steps, COMMIT_STEPS):
        write_steps(lake, RUN, range(start, min(steps, start + COMMIT_STEPS)))
    return time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def browser(profile: Path) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1440,1400",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def wait_js(driver, script: str, timeout: float = 120.0) -> float:
    t0 = time.perf_counter()
    while not driver.execute_script(f"return {script};"):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(script)
        time.sleep(0.01)
    return time.perf_counter() - t0


def bench_page(url: str, lake: Lake, steps: int, profile: Path, updates: int) -> None:
    driver = browser(profile)
    try:
        t0 = time.perf_counter()
        driver.get(f"{url}/runs/{RUN}?token={READER_TOKEN}")
        wait_js(driver, f"window.dash && window.dash.stats.steps['{RUN}'] === {steps - 1}")
        load = time.perf_counter() - t0
        backlog_render = driver.execute_script("return window.dash.stats.maxRenderMs")
        latencies, renders = [], []
        for step in range(steps, steps + updates):
            started = time.perf_counter()
            write_steps(lake, RUN, range(step, step + 1))
            wait_js(driver, f"window.dash.stats.steps['{RUN}'] === {step}", 30)
            latencies.append(time.perf_counter() - started)
            renders.append(driver.execute_script("return window.dash.stats.lastRenderMs"))
            time.sleep(0.2)
        print(f"page: {steps} steps loaded and drawn in {load:.2f} s "
              f"(largest redraw during the backlog {backlog_render:.0f} ms)")
        print(f"page: live update, step written -> drawn: median {statistics.median(latencies):.3f} s, "
              f"max {max(latencies):.3f} s over {updates} steps (4 commits + 0.25 s poll included)")
        print(f"page: redraw of all charts at {steps}+ steps: median {statistics.median(renders):.1f} ms, "
              f"max {max(renders):.1f} ms")
    finally:
        driver.quit()


async def _viewer(client: httpx.AsyncClient, after: int | None, want: int,
                  received: list[tuple[int, float]]) -> None:
    url = f"/v1/runs/{RUN}/metrics/stream" + (f"?after={after}" if after is not None else "")
    async with client.stream("GET", url) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                received.append((int(line[4:]), time.perf_counter()))
                if len(received) == want:
                    return


async def bench_viewers(url: str, lake: Lake, first_new: int, viewers: int, steps: int) -> None:
    new = 20
    limits = httpx.Limits(max_connections=viewers + 10)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits,
                                 timeout=httpx.Timeout(120.0)) as client:
        got: list[list[tuple[int, float]]] = [[] for _ in range(viewers)]
        tasks = [asyncio.create_task(_viewer(client, first_new - 1, new, got[i]))
                 for i in range(viewers)]
        await asyncio.sleep(2.0)  # every viewer connected and waiting
        started: dict[int, float] = {}
        for step in range(first_new, first_new + new):
            # From before the step's 4 commits: the feed may see the last one before the
            # write call returns, so timing from its return would read too low.
            started[step] = time.perf_counter()
            await asyncio.to_thread(write_steps, lake, RUN, range(step, step + 1))
            await asyncio.sleep(0.3)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for events in got:
            assert [s for s, _ in events] == list(range(first_new, first_new + new)), events
        delays = [t - started[s] for events in got for s, t in events]
        print(f"stream: {viewers} viewers x {new} new steps, every step once and in order; "
              f"step written -> received median {statistics.median(delays):.3f} s, "
              f"p99 {pct(delays, 0.99):.3f} s, max {max(delays):.3f} s")

        total = first_new + new
        got = [[] for _ in range(viewers)]
        t0 = time.perf_counter()
        await asyncio.gather(*(_viewer(client, None, total, got[i]) for i in range(viewers)))
        elapsed = time.perf_counter() - t0
        assert all([s for s, _ in events] == list(range(total)) for events in got)
        print(f"stream: {viewers} viewers replaying the whole {total}-step history at once: "
              f"{elapsed:.2f} s ({viewers * total / elapsed:,.0f} events/s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--viewers", type=int, default=100)
    parser.add_argument("--updates", type=int, default=10, help="live steps timed in the page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(free_port()) as broker:
        tmp_path = Path(tmp)
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers,
                              topic_prefix=f"b{uuid.uuid4().hex[:8]}.")
        kafka.ensure_topics()
        lake = Lake(tmp_path / "lake")
        print(f"lake: wrote {args.steps} steps in {build_run(lake, args.steps):.1f} s "
              f"({COMMIT_STEPS} steps per commit)")
        with gateway(kafka, lake.root, tmp_path / "state") as server:
            bench_page(server.url, lake, args.steps, tmp_path / "chromium", args.updates)
            asyncio.run(bench_viewers(server.url, lake, args.steps + args.updates,
                                      args.viewers, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
