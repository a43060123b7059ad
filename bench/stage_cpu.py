"""CPU per step of the processor's pure path (no Kafka, no Delta), best of 5 each.

    .venv/bin/python bench/stage_cpu.py [lists|compact]

40 groups of bench/pipeline.py's stream (8 samples of ~2k response tokens with
log-probs), each step timed over all of them: decode and validate the event bytes,
assemble groups, run the filter chain, build the fragments table, the decision's Arrow
IPC both ways, and the batcher (training rows, advantages, content_sha256). With
PYTHONPATH at another checkout it measures that one, for a before/after on one machine.
"""

import sys
import time

import orjson

from ingest.commands.simulate import SimulationConfig, generate_group
from ingest.core.assembly import GroupBuilder
from ingest.core.batching import RunBatcher
from ingest.core.decide import decide
from ingest.core.decided import fragments_table
from ingest.core.filters import FilterArgs, apply_filter_chain, load_filter
from ingest.processor.decisions import decode_fragments, encode_decision
from schemas.events import RunConfig, decode_event


def best(fn, repeat: int = 5):
    """(best seconds, result) of `repeat` calls: the machine is shared."""
    seconds = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        seconds = min(seconds, time.perf_counter() - start)
    return seconds, out


def assemble(events):
    built = []
    for index, group_events in enumerate(events):
        builder = GroupBuilder("b", index, 0.0)
        for event in group_events:
            builder.apply(event)
        built.append(builder.group)
    return built


def main() -> None:
    form = sys.argv[1] if len(sys.argv) > 1 else "compact"
    sim = SimulationConfig(run_id="b", steps=1, rollout_batch_size=32, n_samples=8,
                           response_len_mean=2048, prompt_len=256, mode="open",
                           duplicate_rate=0.0, seed=3, out_of_order=False)
    # model_copy: an older checkout's config has no such field and sends lists
    sim = sim.model_copy(update={"compact_arrays": form == "compact"})
    groups = [[orjson.dumps(e) for e in generate_group(sim, g, 0).events] for g in range(40)]
    cfg = RunConfig.model_validate(sim.run_config())
    args, user_filter = FilterArgs.from_config(cfg), load_filter(cfg.resolved_filter_path)
    steps: dict[str, float] = {}
    steps["decode + validate"], events = best(
        lambda: [[decode_event(raw) for raw in g] for g in groups])
    tokens = sum(len(e.response_tokens) for g in events for e in g
                 if e.type in ("sample_finished", "compaction_fragment"))
    steps["assembly"], built = best(lambda: assemble(events))
    steps["filter chain"], _ = best(lambda: [apply_filter_chain(args, g, user_filter)
                                             for g in built])
    steps["fragments -> Arrow"], frags = best(
        lambda: [fragments_table(g, None, with_tokens=True) for g in built])
    decided = [decide(g, cfg, at_us=1, source={"partition": 0, "offset": 0},
                      decided_at=1.0).group for g in built]
    steps["decision -> Arrow IPC"], values = best(
        lambda: [encode_decision(d)[1] for d in decided])
    steps["Arrow IPC -> fragments (batch stage)"], _ = best(
        lambda: [decode_fragments(v) for v in values])
    # The kept groups fill one step: the last of them seals it.
    kept = sum(d.header.decision == "kept" for d in decided)
    batch_config = cfg.model_copy(update={"rollout_batch_size": kept})

    def seal():  # one batcher: the last kept decision seals the step
        batcher = RunBatcher("b", batch_config)
        return [s for d in decided for s in batcher.offer(d, now=1.0).sealed]

    steps["batcher: rows, advantages, hash"], sealed = best(seal)
    assert len(sealed) == 1
    total = sum(steps.values())
    print(f"{form}: {tokens:,} response tokens in {len(groups)} groups; {total * 1e3:.0f} ms, "
          f"{tokens / total:,.0f} tokens per CPU second")
    for name, seconds in steps.items():
        print(f"  {name:<38}{seconds * 1e3:>8.1f} ms")


if __name__ == "__main__":
    main()
