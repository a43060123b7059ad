"""What-if: `rolloutlake replay --into L2 --config KEY=VALUE ...` re-derives a run the real
processor wrote under other settings into another lake and diffs it against the original
(decisions, step contents, metrics; table, JSON, PNG), never writing into the original."""

from __future__ import annotations

import json
import os

import matplotlib.image
import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from schemas.tables import TABLES
from tests.integration.pipeline import ordered_kafka, run_processor
from tests.integration.test_cli import cli, one_line_error

pytestmark = pytest.mark.one_broker("diffs lakes a processor wrote")

RUN = "whatif-run"
# Open mode: every group of a step issued at once, so the DAPO filter drops some and the
# groups after the step's seal are surplus.
SIM = SimulationConfig(run_id=RUN, steps=4, rollout_batch_size=3, n_samples=4,
                       response_len_mean=32, prompt_len=8, mode="open", seed=2)


@pytest.fixture(scope="module")
def original(broker, tmp_path_factory) -> str:
    kafka = ordered_kafka(broker.bootstrap_servers, "whatif.")
    run_simulation(kafka, SIM)
    root = str(tmp_path_factory.mktemp("whatif") / "lake")
    run_processor(kafka, root, idle_s=1.5)
    return root


def what_if(original: str, into, *config: str, extra: tuple[str, ...] = ()) -> dict:
    """The JSON diff of a what-if replayed into `into`."""
    done = cli("replay", "--lake", original, "--run", RUN, "--into", str(into), "--json",
               *extra, *(("--config", *config) if config else ()))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def of_run(lake: str, table: str) -> list[dict]:
    return Lake(str(lake)).read(table, filter=pc.field("run_id") == RUN).to_pylist()


def metrics(lake: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for m in of_run(lake, "step_metrics"):
        out.setdefault(m["step"], {})[m["key"]] = m["value"]
    return out


def test_filter_off_rederives_exactly_the_groups_the_filter_dropped(original, tmp_path):
    into, plot = tmp_path / "nofilter", tmp_path / "curves.png"
    diff = what_if(original, into, "filter=none", extra=("--plot", str(plot)))
    before = {g["group_index"]: g for g in of_run(original, "groups")}
    after = {g["group_index"]: g for g in of_run(into, "groups")}
    assert before.keys() == after.keys()
    # The DAPO filter's drops; aborted or timed-out groups stay dropped without a filter.
    filtered = {g for g, row in before.items() if (row["reason"] or "").startswith("zero_std")}
    assert filtered  # the simulated run has zero-std groups
    assert {g for g, row in before.items()
            if row["decision"] == "dropped" and after[g]["decision"] != "dropped"} == filtered
    assert all(after[g]["decision"] in ("kept", "surplus") for g in filtered)
    assert {g for g, row in after.items() if row["decision"] == "dropped"} == {
        g for g, row in before.items() if row["decision"] == "dropped"} - filtered
    # The diff names each of them, with why.
    for g in diff["groups"]:
        if g["group_index"] in filtered:
            assert g["why"].startswith("the what-if keeps what the original dropped for zero_std")
    assert filtered <= {g["group_index"] for g in diff["groups"]}
    # Steps: exactly those whose hashes differ between the two lakes' `steps` tables.
    hashes_before = {s["step"]: s["content_sha256"] for s in of_run(original, "steps")}
    hashes_after = {s["step"]: s["content_sha256"] for s in of_run(into, "steps")}
    assert {s["step"] for s in diff["steps"]} == {
        s for s in hashes_before.keys() | hashes_after.keys()
        if hashes_before.get(s) != hashes_after.get(s)}
    # Metrics: both sides as the lakes hold them, and their difference.
    original_metrics, what_if_metrics = metrics(original), metrics(into)
    for step, keys in diff["metrics"].items():
        for key, m in keys.items():
            assert m["original"] == original_metrics.get(int(step), {}).get(key)
            assert m["what_if"] == what_if_metrics.get(int(step), {}).get(key)
            if m["original"] is not None and m["what_if"] is not None:
                assert m["delta"] == pytest.approx(m["what_if"] - m["original"])
    # Four panels, two a row, of 6x3.5 inches at 100 dpi.
    assert matplotlib.image.imread(plot).shape[:2] == (700, 1200)

    table = cli("replay", "--lake", original, "--run", RUN, "--config", "filter=none")
    assert table.returncode == 0, table.stderr
    assert "what-if: dynamic_sampling_filter_path=None" in table.stdout
    assert f"{len(diff['groups'])} of {diff['groups_compared']} groups changed" in table.stdout


@pytest.fixture(scope="module")
def larger_unfiltered(original, tmp_path_factory) -> tuple[str, int]:
    """The run without a filter and a batch as large as step 0's offered groups (more than
    the run's over-sampling, so `over_sampling_batch_size` must follow): the what-if
    lake and that batch size."""
    batch = int(metrics(original)[0]["rollout/groups_offered"])
    assert batch > SIM.over_sampling
    into = tmp_path_factory.mktemp("whatif") / "larger-unfiltered"
    what_if(original, into, "filter=none", f"rollout_batch_size={batch}",
            f"over_sampling_batch_size={batch}")
    return str(into), batch


def test_filter_off_raw_reward_is_the_originals_unfiltered_where_no_surplus_intervenes(
        original, larger_unfiltered):
    into, batch = larger_unfiltered
    before, after = metrics(original), metrics(into)
    # A step of the what-if that kept every group offered to it trains on what the
    # original offered its filter.
    compared = [s for s, m in after.items() if m["rollout/groups_surplus"] == 0]
    assert 0 in compared
    # The original filtered at step 0: its batch's reward is not the unfiltered one.
    assert before[0]["rollout/groups_kept"] < batch
    assert before[0]["rollout/raw_reward"] != pytest.approx(
        before[0]["rollout/raw_reward_unfiltered"])
    for step in compared:
        assert after[step]["rollout/groups_offered"] == before[step]["rollout/groups_offered"]
        assert after[step]["rollout/raw_reward"] == pytest.approx(
            before[step]["rollout/raw_reward_unfiltered"])


def test_a_larger_batch_seals_fewer_steps(original, larger_unfiltered):
    into, batch = larger_unfiltered
    offered = {s: m["rollout/groups_offered"] for s, m in metrics(original).items()}
    sealed_before = {s["step"] for s in of_run(original, "steps")}
    sealed_after = {s["step"] for s in of_run(into, "steps")}
    # Without a filter every offered group is kept until the batch is full: a step seals
    # when its generation offered at least a batch.
    assert sealed_after == {s for s, n in offered.items() if n >= batch}
    assert sealed_after and sealed_after < sealed_before
    assert {s["n_groups"] for s in of_run(into, "steps")} == {batch}
    shown = cli("replay", "--lake", original, "--run", RUN, "--config", "filter=none",
                f"rollout_batch_size={batch}", f"over_sampling_batch_size={batch}")
    assert shown.returncode == 0, shown.stderr
    only = ", ".join(map(str, sorted(sealed_before - sealed_after)))
    assert f"steps sealed only in the original: {only} (" in shown.stdout


def _versions(lake: str) -> dict[str, int]:
    return {t: Lake(lake).version(t) for t in TABLES if Lake(lake).exists(t)}


def _files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}


def test_a_what_if_never_writes_into_the_original_lake(original, tmp_path):
    versions, files = _versions(original), _files(original)
    assert {"events", "groups", "steps", "step_metrics"} <= versions.keys()
    what_if(original, tmp_path / "elsewhere", "filter=none", "rollout_batch_size=4")
    same = one_line_error(cli("replay", "--lake", original, "--run", RUN, "--into", original,
                              "--config", "filter=none"))
    assert same == (f"rolloutlake replay: --into {original} is the original lake; a replay "
                    "never writes into it, pass another folder")
    inside = os.path.join(original, "whatif")
    nested = one_line_error(cli("replay", "--lake", original, "--run", RUN, "--into",
                                inside + "/", "--config", "filter=none"))
    assert nested == (f"rolloutlake replay: --into {inside}/ lies inside the original lake "
                      f"{original}; a replay never writes into it, pass a folder outside it")
    assert _versions(original) == versions
    assert _files(original) == files


def test_replay_into_errors_are_one_line(original, tmp_path):
    into = tmp_path / "twice"
    what_if(original, into)
    twice = one_line_error(cli("replay", "--lake", original, "--run", RUN, "--into", str(into)))
    assert twice == f"rolloutlake replay: --into {into} already holds run {RUN}; pass an empty lake"
    unwritable = one_line_error(cli("replay", "--lake", original, "--run", RUN, "--plot",
                                    str(tmp_path / "no" / "x.png")))
    assert "--plot" in unwritable and "No such file or directory" in unwritable
    contradiction = one_line_error(cli("replay", "--lake", original, "--run", RUN, "--config",
                                       f"rollout_batch_size={SIM.over_sampling + 1}"))
    assert (f"over_sampling_batch_size ({SIM.over_sampling}) must be >= rollout_batch_size "
            f"({SIM.over_sampling + 1})") in contradiction
