"""The engine on a slice of the synthetic trace, in virtual time, against ground truth."""

from __future__ import annotations

from pathlib import Path

from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.sim._records import StepResult
from kvevents.sim._trace import default_trace_path, load_trace, run_trace
from kvevents.testing.engine import BlockSets, RecordingSink
from kvevents.wire import decode_batch, encode_batch

TRACE = Path(default_trace_path())


def test_trace_slice_events_match_ground_truth_every_step() -> None:
    """120 trace rows, 2 ranks, CPU tier, signed hashes: encoded then decoded events rebuild
    both tiers after every step."""
    rows = load_trace(TRACE, limit=120)
    cfg = EngineConfig(
        block_size=64,
        capacity_blocks=1500,
        cpu_capacity_blocks=600,
        ranks=2,
        max_num_batched_tokens=16384,
        hash_style="signed",
    )
    sinks = [RecordingSink(r) for r in range(2)]
    engine = SimulatedEngine(cfg, publishers=sinks)
    sets = BlockSets()
    mismatches: list[int] = []

    def check(result: StepResult) -> None:
        for batch in result.batches:
            sets.apply(decode_batch(encode_batch(batch)).batch)
        for rank in range(2):
            for medium in ("GPU", "CPU"):
                if sets.blocks(rank, medium) != engine.cached_blocks(rank, medium):
                    mismatches.append(rank)

    run = run_trace(engine, rows, on_step=check)
    m = run.metrics
    assert mismatches == [] and sets.violations == []
    assert m.finished == 120 and m.input_tokens == sum(r.input_length for r in rows)
    assert m.cached_tokens > 0 and m.batches == sum(len(s.batches) for s in sinks)
    assert sum(engine.cache_stats(r).offloaded_blocks for r in range(2)) > 0
    assert m.virtual_time >= rows[-1].arrival
    assert any(h < 0 for h in engine.cached_blocks(0))


def test_router_hook_picks_ranks() -> None:
    """run_trace asks the router for each request's rank."""
    rows = load_trace(TRACE, limit=6)
    engine = SimulatedEngine(EngineConfig(block_size=64, ranks=2, capacity_blocks=4000))
    seen: list[str] = []

    def router(request: object, eng: SimulatedEngine) -> int:
        seen.append(request.request_id)  # type: ignore[attr-defined]
        return 1

    run_trace(engine, rows, router=router)
    assert seen == [f"trace-{i}" for i in range(6)]
    assert engine.recorder_stats(0).batches == 0 and engine.recorder_stats(1).batches > 0


def test_real_time_mode_paces_and_finishes() -> None:
    """Real-time mode with a large speedup serves the rows and stamps wall-clock ts."""
    rows = load_trace(TRACE, limit=3)
    import time

    sink = RecordingSink()
    engine = SimulatedEngine(
        EngineConfig(block_size=64, capacity_blocks=4000, step_base_s=0.0, step_token_s=0.0),
        publishers=[sink],
        clock=time.time,
    )
    start = time.time()
    run = run_trace(engine, rows, realtime=True, speedup=1000.0)
    assert run.metrics.finished == 3 and all(b.ts >= start for b in sink.batches)
