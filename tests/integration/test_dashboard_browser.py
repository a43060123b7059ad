"""The dashboard in a real headless Chromium against a live gateway and a growing run.

Needs Debian's `chromium` and `chromium-driver` (deploy/install-test-deps.sh). Saves the
screenshot as artifacts/dashboard.png.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import orjson
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.main import Processor
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from tests.support.metric_fixtures import READER_TOKEN, gateway, write_steps

RUN, OTHER = "dapo-live", "dapo-seed2"
CHARTS = ("groups", "reward", "zerostd", "cost", "bias", "lengths")
ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard.png"

pytestmark = [pytest.mark.one_broker(
    "the dashboard reads the lake; the broker only builds it"), pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="chromium and chromium-driver are not installed (deploy/install-test-deps.sh)",
)]


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                 f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1440,1500"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 20.0):
    """Poll a JS expression until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {script};")
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}")


INKED_PIXELS = """
const c = document.querySelector('#chart-' + arguments[0] + ' canvas');
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
return n;
"""


def test_dashboard_draws_live_steps_without_reload(kafka, lake_root, tmp_path, browser):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 40))
    write_steps(lake, OTHER, range(0, 40), seed=2)
    with gateway(kafka, lake_root, tmp_path) as server:
        browser.get(f"{server.url}/runs/{RUN}?compare={OTHER}&token={READER_TOKEN}")
        wait_for(browser, f"window.dash.stats.steps['{RUN}'] === 39 && "
                          f"window.dash.stats.steps['{OTHER}'] === 39")
        wait_for(browser, "window.dash.charts.lengths")
        assert "token" not in browser.current_url  # moved to sessionStorage

        for name in CHARTS:
            points = browser.execute_script(
                f"return window.dash.charts['{name}'].data[0].length")
            assert points > 0, name
            assert browser.execute_script(INKED_PIXELS, name) > 2000, f"{name} is blank"
        labels = browser.execute_script(
            "return [...document.querySelectorAll('#chart-reward .u-legend th')]"
            ".map(e => e.textContent)")
        for key in ("raw_reward (kept)", "raw_reward_unfiltered", "episode_raw_reward"):
            assert any(key in label and RUN in label for label in labels), key
            assert any(key in label and OTHER in label for label in labels), key
        stacked = browser.execute_script(
            "return window.dash.charts.groups.series.map(s => s.label)")
        assert {"kept", "cancelled at seal"} <= set(stacked)
        assert any(label.startswith("dropped zero_std_") for label in stacked)

        # A step seals while the page is open: it appears without a reload.
        browser.execute_script("window.__not_reloaded = true")
        renders = browser.execute_script("return window.dash.stats.renders")
        write_steps(lake, RUN, range(40, 41))
        wait_for(browser, f"window.dash.stats.steps['{RUN}'] === 40")
        assert browser.execute_script("return window.__not_reloaded") is True
        assert browser.execute_script("return window.dash.stats.renders") > renders
        assert browser.execute_script(
            "return window.dash.charts.reward.data[0].includes(40)")
        assert "step 40" in browser.find_element(By.ID, "status").text
        assert browser.execute_script("return window.dash.stats.lastRenderMs") < 1000

        # The latest groups table links to each group's audit view.
        wait_for(browser, "document.querySelectorAll('#groups-body tr').length === 15")
        first = browser.find_element(By.CSS_SELECTOR, "#groups-body a[data-group]")
        group = first.get_attribute("data-group")
        assert first.get_attribute("href").endswith(f"/v1/runs/{RUN}/groups/{group}")
        first.click()
        wait_for(browser, "document.getElementById('audit-body').textContent.includes('decision')")
        browser.find_element(By.ID, "audit-close").click()

        ARTIFACT.parent.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACT))
    assert ARTIFACT.stat().st_size > 50_000


def test_index_lists_runs_and_asks_for_a_token_when_missing(kafka, lake_root, tmp_path, browser):
    write_steps(Lake(lake_root), RUN, range(0, 3))
    with gateway(kafka, lake_root, tmp_path) as server:
        browser.get(f"{server.url}/")
        wait_for(browser, "!document.getElementById('auth').hidden")
        browser.find_element(By.ID, "token").send_keys(READER_TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#auth-form button").click()
        wait_for(browser, "document.querySelectorAll('#runs-body a').length === 1")
        link = browser.find_element(By.CSS_SELECTOR, "#runs-body a")
        assert link.text == RUN
        link.click()
        wait_for(browser, f"window.dash && window.dash.stats.steps['{RUN}'] === 2")


def _publish_steps(kafka, sim: SimulationConfig, steps: range) -> None:
    with RolloutPublisher(kafka) as pub:
        pub.run_started(sim.run_id, sim.run_config(), event_id=f"{sim.run_id}-run")
        for group in open_loop_groups(sim):
            if group.step in steps:
                for body in group.events:
                    pub.send_raw(pub.topics.events,
                                 event_group_key(sim.run_id, body["group_index"]),
                                 orjson.dumps(body))


def test_dashboard_follows_a_simulated_run_through_the_processor(kafka, lake_root, tmp_path,
                                                                 browser):
    sim = SimulationConfig(run_id="sim-live", steps=6, rollout_batch_size=4, n_samples=4,
                           response_len_mean=32, prompt_len=8, mode="open", seed=5)
    processor = Processor(ProcessorConfig(kafka=kafka, lake=lake_root))
    thread = threading.Thread(target=processor.run, daemon=True)
    thread.start()
    try:
        _publish_steps(kafka, sim, range(0, 3))
        with gateway(kafka, lake_root, tmp_path) as server:
            browser.get(f"{server.url}/runs/{sim.run_id}?token={READER_TOKEN}")
            # Steps 0 and 1 closed when step 2 sealed: their metrics are on the page.
            try:
                wait_for(browser, f"window.dash.stats.steps['{sim.run_id}'] === 1", timeout=90)
            except AssertionError:
                lake = Lake(lake_root)
                raise AssertionError(
                    f"errors={processor.errors} steps={lake.read('steps').num_rows} "
                    f"metrics={lake.read('step_metrics').num_rows} "
                    f"events={lake.read('events').num_rows} "
                    f"page={browser.execute_script('return window.dash && window.dash.stats')}"
                ) from None
            browser.execute_script("window.__not_reloaded = true")
            _publish_steps(kafka, sim, range(3, 6))
            wait_for(browser, f"window.dash.stats.steps['{sim.run_id}'] === 4", timeout=90)
            assert browser.execute_script("return window.__not_reloaded") is True
            for name in ("groups", "reward"):
                assert browser.execute_script(INKED_PIXELS, name) > 2000, f"{name} is blank"
    finally:
        processor.stop()
        thread.join()
