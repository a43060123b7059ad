"""The processor's W&B sink: each sealed step's `step_metrics`, logged once to Weights & Biases.

Each sealed step is logged once with `step=<step>` under its `step_metrics` keys, which
are Miles' keys, so existing W&B panels work unchanged. W&B runs offline unless the user
sets `WANDB_MODE`: nothing leaves the machine by default. `rolloutlake process --wandb`
follows every run with `follow_all_runs`; `rolloutlake wandb-sync` syncs one run.

Resume: after a batch of steps is handed to W&B, the last step is committed as the Delta
transaction version of the `wandb_sync` table (one app id per W&B run), next to a row
recording the batch. A restart reads that version and logs only later steps, so a
restarted sync never re-logs a synced step. A crash between handing steps to W&B and
the commit re-logs at most that batch; W&B keeps one value per key and step when the
runs are synced or resumed online, so even that window leaves no duplicate on the server.
W&B writes its files asynchronously and offers no flush short of `finish()`, which a
normal stop (Ctrl-C, SIGTERM, the end of a non-follow sync) always runs; only a hard
kill within about a second of a batch can leave that batch recorded but not in W&B's
files (re-sync it with `--wandb-id` of a fresh W&B run).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from ingest.io.lake import Lake, TxnMark
from ingest.io.tail import StepTail
from schemas.errors import RolloutlakeError
from schemas.tables import WANDB_SYNC

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "rolloutlake"


def _app_id(project: str, wandb_id: str) -> str:
    # Per W&B run: syncing the same lake run to a second project starts from scratch.
    return f"wandb-sync/{project}/{wandb_id}"


def last_synced_step(lake: Lake, *, project: str, wandb_id: str) -> int | None:
    """The last step durably recorded as logged to this W&B run, None before the first."""
    if not lake.exists(WANDB_SYNC.name):
        return None
    return lake.txn_version(WANDB_SYNC.name, _app_id(project, wandb_id))


def sync_run(
    lake: Lake,
    run_id: str,
    *,
    project: str = DEFAULT_PROJECT,
    entity: str | None = None,
    wandb_id: str | None = None,
    wandb_dir: str | Path | None = None,
    mode: str | None = None,
    follow: bool = False,
    poll_s: float = 2.0,
    stop: threading.Event | None = None,
) -> int:
    """Log every sealed step of `run_id` not yet synced; returns how many were logged.

    With `follow`, keeps logging steps as they seal until `stop` is set (the processor
    runs it in a thread this way); without, logs what is sealed now and returns.
    `mode` defaults to `$WANDB_MODE`, else `offline`.
    """
    try:
        import wandb
    except ImportError:
        raise RolloutlakeError("wandb is not installed (pip install 'rolloutlake[trainer]')") from None
    wandb_id = wandb_id or run_id
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    app_id = _app_id(project, wandb_id)
    after = last_synced_step(lake, project=project, wandb_id=wandb_id)
    tail = StepTail(lake, run_id, after=after)
    stop = stop or threading.Event()
    run = wandb.init(
        # $WANDB_MODE goes through as set: wandb.init checks it and names the valid modes.
        project=project, entity=entity, id=wandb_id, resume="allow", mode=mode,  # type: ignore[arg-type]
        dir=str(wandb_dir) if wandb_dir else None, job_type="rollout-metrics",
        config={"rolloutlake_run_id": run_id}, settings=wandb.Settings(silent=True),
        reinit="create_new",  # the processor syncs several runs at once
    )
    log.info("wandb-sync run=%s wandb=%s/%s mode=%s after step %s",
             run_id, project, wandb_id, mode, after)
    logged = 0
    final = False
    try:
        while True:
            steps = tail.poll()
            for s in steps:
                run.log(s.metrics, step=s.step)
            if steps:
                row = pa.table({
                    "run_id": [run_id], "wandb_run": [f"{project}/{wandb_id}"],
                    "last_step": [steps[-1].step], "n_steps": [len(steps)],
                    "synced_at": [datetime.now(UTC)],
                })
                lake.append(WANDB_SYNC.name, row, marks=[TxnMark(app_id, steps[-1].step)])
                logged += len(steps)
                log.info("wandb-sync run=%s logged steps %d..%d",
                         run_id, steps[0].step, steps[-1].step)
            if not follow or final:
                return logged
            final = stop.wait(poll_s)  # once stopped, one last poll picks up the last steps
    finally:
        run.finish()


def follow_all_runs(lake: Lake, run_ids: Callable[[], Iterable[str]], stop: threading.Event, *,
                    wandb_dir: str | Path | None = None, poll_s: float = 2.0) -> None:
    """The processor's `--wandb`: follow every run `run_ids()` names, one thread per run,
    until `stop` is set (then each W&B run is finished)."""
    threads: dict[str, threading.Thread] = {}
    final = False
    while True:
        for run_id in run_ids():
            if run_id not in threads:
                threads[run_id] = threading.Thread(
                    target=sync_run, args=(lake, run_id),
                    kwargs={"follow": True, "stop": stop, "poll_s": poll_s,
                            "wandb_dir": wandb_dir},
                    name=f"wandb-{run_id}", daemon=True)
                threads[run_id].start()
        if final:
            break
        # Once stopped, one last look: a run that appeared since is still synced.
        final = stop.wait(poll_s)
    for thread in threads.values():
        thread.join(timeout=60)
