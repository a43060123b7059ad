"""The whole RL loop for a few steps: dataset upload and prompts through the gateway,
worker, real engine, broker, processor, Delta, DeepSpeed trainer, weights back to the
engine, the dashboard live.

The engine is vLLM's CPU build, or SGLang with `ROLLOUTLAKE_TEST_ENGINE=sglang`
(`make test-gpu`). One engine serves the module; each run loads its own initial policy
into it. What the loop did is read back from the lake and the trainer's weight folders,
and the engine's log-probs are recomputed in torch from those folders; the dashboard's
page and reads are fetched from the gateway while the run goes on.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

from ingest.commands.loop import DATASET, GATEWAY_TOKENS, RUN_ID, LoopConfig, StepRow, run_loop
from ingest.io.broker import free_port
from ingest.workers.config import EngineServerConfig
from ingest.workers.engine_server import EngineServer
from tests.integration.pipeline import rows
from tests.support.engine_under_test import engine_under_test

pytestmark = [pytest.mark.slow,
              pytest.mark.one_broker("the loop's parts; their broker path is the SDK's")]

STEPS = 3
ENGINE = engine_under_test()


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    with EngineServer(EngineServerConfig(backend=ENGINE, port=free_port(),
                                         tiny_dir=root / "tiny",
                                         log_file=root / "engine.log")) as server:
        yield server.url


def log_probs(model_dir, prompt: list[int], response: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    picked = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(response)[:, None])
    return picked[:, 0].tolist()


class Dashboard:
    """What the dashboard printed at the start of the loop serves while the run goes on:
    fetched once, when the first trained step lands."""

    def __init__(self, out):
        self.out = out
        self.status: list[str] = []
        self.answers: dict[str, httpx.Response] = {}
        self.first_step: str | None = None

    def on_row(self, row: StepRow) -> None:
        if self.answers:
            return
        url = next(line.split()[1] for line in self.status if line.startswith("dashboard: "))
        base = url.removesuffix(f"/runs/{RUN_ID}")
        token = (self.out / "gateway" / "dashboard.token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base, timeout=60) as client:
            self.answers = {
                "page": client.get(url),
                "runs": client.get("/v1/dashboard/runs", headers=auth),
                "metrics": client.get(f"/v1/runs/{RUN_ID}/metrics", headers=auth),
                "no token": client.get(f"/v1/runs/{RUN_ID}/metrics"),
                "cursor": client.get(f"/v1/runs/{RUN_ID}/prompts/cursor", headers=auth),
            }
            with client.stream("GET", f"/v1/runs/{RUN_ID}/metrics/stream",
                               headers=auth) as stream:
                self.first_step = next(line for line in stream.iter_lines()
                                       if line.startswith("data: "))


def events(lake_root, kind: str) -> list[dict]:
    return [r for r in rows(lake_root, "events", RUN_ID) if r["type"] == kind]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_weights_flow_through_the_whole_loop_and_no_stale_sample_is_trained(
        engine_url, kafka, tmp_path, zero_stage):
    out = tmp_path / "loop"
    dashboard = Dashboard(out)
    result = run_loop(LoopConfig(
        steps=STEPS, groups=3, n_samples=4, max_new_tokens=6, zero_stage=zero_stage,
        out=out, engine=ENGINE, engine_url=engine_url,
        bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
        step_timeout_s=300), on_row=dashboard.on_row, on_status=dashboard.status.append)
    assert [r.step for r in result.rows] == list(range(STEPS))

    # The prompts came through the gateway: its run_started (the only one) names the
    # uploaded dataset, and every group_started is the gateway's, from the dataset's rows
    # in file order (row g mod 10, the digit itself).
    [started] = events(out / "lake", "run_started")
    run = orjson.loads(started["payload"])
    assert run["dataset"] == DATASET
    assert (run["config"]["rollout_batch_size"], run["config"]["n_samples_per_prompt"],
            run["config"]["rollout_shuffle"]) == (3, 4, False)
    groups = sorted(events(out / "lake", "group_started"), key=lambda r: r["group_index"])
    assert [g["group_index"] for g in groups] == list(range(3 * STEPS))
    for group in groups:
        payload = orjson.loads(group["payload"])
        assert group["event_id"] == f"{RUN_ID}/group_started/{group['group_index']}"
        assert payload["prompt_ref"]["dataset"] == DATASET
        assert payload["prompt"] == str(group["group_index"] % 10)
    # The gateway's cursor checkpoint (written at its shutdown) has served them all.
    cursor = max(rows(out / "lake", "prompt_cursor", RUN_ID), key=lambda r: r["seq"])
    assert (cursor["dataset"], cursor["next_group_index"]) == (DATASET, 3 * STEPS)

    # The dashboard answered while the run went on, with the read token and only with it.
    answers = dashboard.answers
    assert answers["page"].status_code == 200 and "dashboard.js" in answers["page"].text
    assert answers["no token"].status_code == 401
    assert [r["run_id"] for r in answers["runs"].json()] == [RUN_ID]
    first = answers["metrics"].json()["steps"][0]
    assert first["step"] == 0 and "rollout/episode_raw_reward" in first["metrics"]
    assert answers["cursor"].json()["dataset"] == DATASET
    assert dashboard.first_step is not None
    assert orjson.loads(dashboard.first_step.removeprefix("data: "))["step"] == 0
    # No token reached a log or the terminal.
    logs = [p.read_text(errors="replace") for p in out.glob("*.log")] + dashboard.status
    for holder in GATEWAY_TOKENS:
        token = (out / "gateway" / f"{holder}.token").read_text().strip()
        assert not any(token in text for text in logs), holder

    trained = sorted(rows(out / "lake", "trainer_steps", RUN_ID), key=lambda r: r["step"])
    assert [(r["step"], r["update"]) for r in trained] == [(s, s + 1) for s in range(STEPS)]
    weights = out / "trainer" / RUN_ID / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [f"step_{s:09d}" for s in range(STEPS)]

    batch = rows(out / "lake", "training_batches", RUN_ID)
    assert {r["step"] for r in batch} == set(range(STEPS))
    # max_staleness 0: step s is generated by the weights of update s (trained on steps
    # 0..s-1), and nothing older is trained.
    assert {(r["step"], r["weight_version"]) for r in batch} == {(s, s) for s in range(STEPS)}

    # The engine generated with the weights it was sent: each row's log-probs are those of
    # its version's folder, and no longer those of the initial policy.
    folders = {0: out / "policy", **{s + 1: weights / f"step_{s:09d}" for s in range(STEPS)}}
    for row in [r for r in batch if r["step"] > 0][:6]:
        prompt, response = row["prompt_tokens"], row["response_tokens"]
        served = log_probs(folders[row["weight_version"]], prompt, response)
        assert row["rollout_log_probs"] == pytest.approx(served, abs=2e-3)
        initial = log_probs(folders[0], prompt, response)
        assert max(abs(a - b) for a, b in zip(served, initial, strict=True)) > 1e-2
    assert result.plot is not None and result.plot.stat().st_size > 0
