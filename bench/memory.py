"""Memory the group stage holds for undecided groups, against the Arrow size of their tokens.

    .venv/bin/python bench/memory.py [--groups 1000 10000] [--response-len 2048]

Each undecided group is a `group_started` and one ~2k-token `sample_finished` (compact
token arrays, log-probs, as the SDK sends them) of the 8 samples it expects, so none is
decided. Every event goes the group stage's way: `decode_event` of its Kafka bytes, then
`GroupBuilder.apply` into a dict of builders like `GroupStage.pending`; the bytes are
dropped after each event, as the stage drops a poll's records once they are archived.
The growth of this process's RSS (after `gc.collect()`, over the imports and one warm-up
group) is the state's memory. "Arrow size" is what those tokens take as the `samples`
table's list columns: prompt and response ids (int32), loss mask (int8), log-probs
(float32), plus one int32 offset per list; a mask the event left out (all ones) counts
nothing. Target: RSS growth within 2x of it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.commands.simulate import SimulationConfig, generate_group  # noqa: E402
from ingest.core.assembly import GroupBuilder  # noqa: E402
from ingest.io.allocator import reuse_large_buffers  # noqa: E402
from schemas.events import TRAJECTORY_EVENT_TYPES, decode_event  # noqa: E402
from schemas.token_arrays import TOKEN_IDS, decode_token_array  # noqa: E402

TOKEN_COLUMNS = ("prompt_tokens", "response_tokens", "loss_mask", "rollout_log_probs")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def template(response_len: float) -> tuple[dict, dict]:
    """A group's `group_started` and the `sample_finished` whose response is closest to
    `response_len` tokens, as decoded JSON."""
    sim = SimulationConfig(run_id="memory", steps=1, rollout_batch_size=1, n_samples=8,
                           response_len_mean=response_len, prompt_len=256, mode="open",
                           abort_rate=0, missing_reward_rate=0, duplicate_rate=0, seed=5)
    events = [orjson.loads(raw) for raw in map(orjson.dumps, generate_group(sim, 0, 0).events)]
    started = next(e for e in events if e["type"] == "group_started")
    samples = [e for e in events if e["type"] == "sample_finished"]
    sample = min(samples, key=lambda e: abs(
        len(decode_token_array(TOKEN_IDS, e["response_tokens"])) - response_len))
    return started, sample


def hold_undecided(n_groups: int, started: dict, sample: dict) -> tuple[dict, int]:
    """Builders of `n_groups` undecided groups, and the Arrow bytes of their tokens."""
    pending: dict[int, GroupBuilder] = {}
    arrow_bytes = 0
    for index in range(n_groups):
        builder = pending[index] = GroupBuilder("memory", index, 0.0)
        for body in (started, sample):
            raw = orjson.dumps({**body, "group_index": index,
                                "event_id": f"{body['event_id']}-{index}"})
            result = builder.apply(decode_event(raw, allowed=TRAJECTORY_EVENT_TYPES))
            assert result.accepted, result.reason
        fragment = builder.group.rollouts[sample["rollout_id"]].fragments[0]
        arrays = [getattr(fragment, name) for name in TOKEN_COLUMNS]
        arrow_bytes += sum(array.nbytes + 4 for array in arrays if array is not None)
    assert not any(builder.group.complete for builder in pending.values())
    return pending, arrow_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--response-len", type=float, default=2048.0)
    args = parser.parse_args()
    reuse_large_buffers()  # as the processor runs
    started, sample = template(args.response_len)
    hold_undecided(1, started, sample)  # warm-up: lazily built validators, caches
    print(f"{'undecided groups':>16}{'tokens/group':>14}{'Arrow MiB':>11}{'RSS growth MiB':>16}"
          f"{'RSS MiB':>9}{'growth / Arrow':>16}")
    for n_groups in args.groups:
        gc.collect()
        before = rss_bytes()
        pending, arrow_bytes = hold_undecided(n_groups, started, sample)
        gc.collect()
        after = rss_bytes()
        tokens = len(pending[0].group.rollouts[sample["rollout_id"]].fragments[0].response_tokens)
        print(f"{n_groups:>16,}{tokens:>14,}{arrow_bytes / 2**20:>11.1f}"
              f"{(after - before) / 2**20:>16.1f}{after / 2**20:>9.0f}"
              f"{(after - before) / arrow_bytes:>15.2f}x")
        del pending


if __name__ == "__main__":
    main()
