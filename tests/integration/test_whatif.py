"""`rolloutlake whatif`: a run replayed into another lake under other settings, diffed
against the original (decisions, step contents, metrics; table, JSON, PNG)."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from tests.integration.pipeline import ordered_kafka, run_processor
from tests.integration.test_cli import cli, one_line_error

pytestmark = pytest.mark.one_broker("diffs lakes a processor wrote")

RUN = "whatif-run"


@pytest.fixture(scope="module")
def original(broker, tmp_path_factory) -> str:
    kafka = ordered_kafka(broker.bootstrap_servers, "whatif.")
    run_simulation(kafka, SimulationConfig(run_id=RUN, steps=4, rollout_batch_size=3,
                                           n_samples=4, response_len_mean=32, prompt_len=8,
                                           mode="open", seed=2))
    root = str(tmp_path_factory.mktemp("whatif") / "lake")
    run_processor(kafka, root, idle_s=1.5)
    return root


def replayed(original: str, into, *flags: str) -> str:
    done = cli("replay", "--lake", original, "--run", RUN, "--out", str(into), *flags)
    assert done.returncode == 0, done.stderr
    return str(into)


def of_run(lake: str, table: str) -> list[dict]:
    return Lake(lake).read(table, filter=pc.field("run_id") == RUN).to_pylist()


def test_filter_off_changes_exactly_the_dropped_groups(original, tmp_path):
    what_if = replayed(original, tmp_path / "nofilter", "--filter", "none")
    plot = tmp_path / "curves.png"
    shown = cli("whatif", "--lake", original, "--what-if", what_if, "--run", RUN, "--json",
                "--plot", str(plot))
    assert shown.returncode == 0, shown.stderr
    diff = json.loads(shown.stdout)
    # The DAPO filter's drops; aborted or timed-out groups stay dropped without a filter.
    dropped = {g["group_index"] for g in of_run(original, "groups")
               if (g["reason"] or "").startswith("zero_std")}
    assert dropped  # the simulated run has zero-std groups
    changed_decision = {g["group_index"] for g in diff["groups"]
                        if g["original"]["decision"] != g["what_if"]["decision"]}
    assert dropped <= changed_decision
    assert {g["group_index"] for g in diff["groups"]
            if g["original"]["decision"] == "dropped"} == dropped
    for g in diff["groups"]:
        if g["group_index"] in dropped:
            assert g["what_if"]["decision"] in ("kept", "surplus")
            assert g["why"].startswith("the what-if keeps what the original dropped for zero_std")
    # Steps: exactly those whose hashes differ between the two lakes' `steps` tables.
    before = {s["step"]: s["content_sha256"] for s in of_run(original, "steps")}
    after = {s["step"]: s["content_sha256"] for s in of_run(what_if, "steps")}
    assert {s["step"] for s in diff["steps"]} == {
        s for s in before.keys() | after.keys() if before.get(s) != after.get(s)}
    # Metrics: both sides as the lakes hold them, and their difference.
    values = {(m["step"], m["key"]): m["value"] for m in of_run(what_if, "step_metrics")}
    for step, keys in diff["metrics"].items():
        for key, m in keys.items():
            assert m["what_if"] == values.get((int(step), key))
            if m["original"] is not None and m["what_if"] is not None:
                assert m["delta"] == pytest.approx(m["what_if"] - m["original"])
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    table = cli("whatif", "--lake", original, "--what-if", what_if, "--run", RUN)
    assert table.returncode == 0, table.stderr
    assert f"{len(diff['groups'])} of {diff['groups_compared']} groups changed" in table.stdout


def test_a_larger_batch_seals_fewer_steps(original, tmp_path):
    what_if = replayed(original, tmp_path / "bigger", "--rollout-batch-size", "6")
    diff = json.loads(cli("whatif", "--lake", original, "--what-if", what_if, "--run", RUN,
                          "--json").stdout)
    only_original = [s["step"] for s in diff["steps"] if s["what_if_sha256"] is None]
    assert only_original  # fewer steps sealed
    assert len(of_run(what_if, "steps")) == len(of_run(original, "steps")) - len(only_original)


def test_whatif_errors_are_one_line(original, tmp_path):
    empty = one_line_error(cli("whatif", "--lake", original, "--what-if", str(tmp_path),
                               "--run", RUN))
    assert "has no groups of run 'whatif-run' (replay the run into it first)" in empty
    same = one_line_error(cli("whatif", "--lake", original, "--what-if", original, "--run", RUN))
    assert "--what-if is the original lake" in same
    what_if = replayed(original, tmp_path / "same")
    unwritable = one_line_error(cli("whatif", "--lake", original, "--what-if", what_if,
                                    "--run", RUN, "--plot", str(tmp_path / "no" / "x.png")))
    assert "--plot" in unwritable and "No such file or directory" in unwritable
