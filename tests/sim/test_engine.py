"""The simulated engine: chunked prefill, decode, hits, completion, ranks, publishing."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvevents.events import AllBlocksCleared, BlockStored
from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.sim._records import Request
from kvevents.testing.engine import BlockSets, RecordingSink

BS = 4


def engine(ranks: int = 1, **kw: object) -> tuple[SimulatedEngine, list[RecordingSink]]:
    cfg = EngineConfig(block_size=BS, ranks=ranks, **kw)  # type: ignore[arg-type]
    sinks = [RecordingSink(r) for r in range(ranks)]
    return SimulatedEngine(cfg, publishers=sinks), sinks


def drain(eng: SimulatedEngine, limit: int = 1000) -> int:
    steps = 0
    while eng.has_work() and steps < limit:
        eng.step()
        steps += 1
    return steps


def stores(sink: RecordingSink) -> list[BlockStored]:
    return [e for e in sink.events() if isinstance(e, BlockStored)]


def test_chunked_prefill_respects_the_token_budget() -> None:
    """A 20-token prompt under an 8-token budget takes three steps, each a chained store."""
    eng, (sink,) = engine(max_num_batched_tokens=8, cache_decode_blocks=False)
    eng.submit(Request("a", list(range(20)), max_output_tokens=1))
    results = [eng.step() for _ in range(3)]
    assert [r.tokens for r in results] == [8, 8, 4] and results[-1].finished == ["a"]
    events = stores(sink)
    assert [len(e.block_hashes) for e in events] == [2, 2, 1]
    assert events[1].parent_block_hash == events[0].block_hashes[-1]
    assert eng.step().batches == [] and len(sink.batches) == 3


def test_decode_blocks_are_announced_when_enabled() -> None:
    """Generated tokens that fill a block are cached and announced (vLLM's behaviour)."""
    eng, (sink,) = engine()
    eng.submit(Request("a", list(range(4)), max_output_tokens=6))
    drain(eng)
    assert sum(len(e.block_hashes) for e in stores(sink)) == 2
    assert eng.metrics().decode_tokens == 5
    eng2, (sink2,) = engine(cache_decode_blocks=False)
    eng2.submit(Request("a", list(range(4)), max_output_tokens=6))
    drain(eng2)
    assert sum(len(e.block_hashes) for e in stores(sink2)) == 1


def test_a_replayed_answer_is_cached_and_the_next_turn_hits_it() -> None:
    """A request given its answer's tokens generates them: its decode blocks hold them, so a
    next turn whose prompt goes on through that answer hits them; the simulator's own tokens
    would not match (the last generated token is never run, as in vLLM)."""
    prompt, answer = list(range(4)), [40, 41, 42, 43, 44]
    follow = [*prompt, *answer, 90, 91, 92]  # 12 tokens: three blocks, the last computed
    for given, hit in ((answer, 8), ((), 4)):
        eng, (sink,) = engine()
        eng.submit(Request("a", prompt, max_output_tokens=6, output_token_ids=given))
        drain(eng)
        assert sum(len(e.block_hashes) for e in stores(sink)) == 2
        eng.submit(Request("b", follow, max_output_tokens=1))
        drain(eng)
        [record] = [r for r in eng.finished_requests if r.request_id == "b"]
        assert record.cached_tokens == hit


def test_prefix_hit_at_admission_is_counted_and_capped() -> None:
    """A repeated block-aligned prompt is served from cache but for its last block (it holds
    the last token, which vLLM computes again: its hit covers tokens but the last, in whole
    blocks), and is not re-announced."""
    eng, (sink,) = engine(cache_decode_blocks=False)
    prompt = list(range(8))
    eng.submit(Request("a", prompt))
    drain(eng)
    assert eng.cached_prefix_blocks(prompt, 0) == 2
    eng.submit(Request("b", prompt))
    drain(eng)
    m = eng.metrics()
    assert (m.input_tokens, m.cached_tokens, m.prefill_tokens) == (16, 4, 12)
    assert len(stores(sink)) == 1


def test_completion_releases_references() -> None:
    """After every request ends, nothing is in use and all cached blocks are evictable."""
    eng, _ = engine(capacity_blocks=16)
    for i in range(3):
        eng.submit(Request(f"r{i}", [i] * 10, max_output_tokens=3))
    drain(eng)
    load = eng.load(0)
    assert load.active_blocks == 0 and load.running_requests == 0
    assert load.free_blocks + load.cached_blocks == 16 and eng.metrics().finished == 3


def test_queued_load_counts_the_prefill_still_to_compute() -> None:
    """A running prompt under chunked prefill keeps its uncomputed part in queued_blocks,
    next to the waiting prompts: the router sees prefill already promised to that rank."""
    eng, _ = engine(max_num_batched_tokens=8, cache_decode_blocks=False)
    eng.submit(Request("long", list(range(40)), max_output_tokens=1))  # 10 blocks of prefill
    assert eng.load(0).queued_blocks == 10
    eng.step()  # 8 tokens computed, 32 (8 blocks) to go
    load = eng.load(0)
    assert (load.running_requests, load.queued_blocks) == (1, 8)
    eng.submit(Request("next", list(range(100, 112))))  # waiting: 3 more blocks
    assert eng.load(0).queued_blocks == 11
    drain(eng)
    assert eng.load(0).queued_blocks == 0


def test_ranks_publish_their_own_batches() -> None:
    """A request pinned to rank 1 shows up only in rank 1's batches, with its rank number."""
    eng, sinks = engine(ranks=2)
    eng.submit(Request("a", list(range(8))), rank=1)
    drain(eng)
    assert sinks[0].batches == []
    assert {b.data_parallel_rank for b in sinks[1].batches} == {1}
    assert eng.cached_prefix_blocks(list(range(8)), 1) == 2
    assert eng.cached_prefix_blocks(list(range(8)), 0) == 0
    with pytest.raises(ValueError, match="rank 2 out of range for an engine of 2 ranks"):
        eng.submit(Request("b", [1]), rank=2)


def test_default_rank_is_the_least_loaded() -> None:
    """Without a rank, requests go to the rank with fewer queued and active blocks."""
    eng, _ = engine(ranks=2)
    assert eng.submit(Request("a", list(range(40)))) == 0
    assert eng.submit(Request("b", list(range(4)))) == 1
    assert eng.submit(Request("c", list(range(4)))) == 1


def test_request_larger_than_capacity_is_rejected() -> None:
    """A request that could never fit is refused up front instead of stalling the rank."""
    eng, _ = engine(capacity_blocks=4)
    assert eng.submit(Request("big", list(range(16)), max_output_tokens=2)) is None
    assert eng.metrics().rejected == 1 and not eng.has_work()


def test_memory_pressure_preempts_and_events_stay_exact() -> None:
    """Decode growth beyond capacity preempts the newest request; events still match truth."""
    eng, _ = engine(capacity_blocks=8, max_num_batched_tokens=64)
    for i in range(4):
        eng.submit(Request(f"r{i}", [i] * 8, max_output_tokens=12))
    sets = BlockSets()
    while eng.has_work():
        for batch in eng.step().batches:
            sets.apply(batch)
        assert sets.blocks(0, "GPU") == eng.cached_blocks(0)
    assert eng.metrics().preemptions > 0 and eng.metrics().finished == 4
    assert sets.violations == []


def test_blocks_of_a_finished_request_serve_the_queue_from_the_next_step() -> None:
    """vLLM frees a request's blocks once the step that made its last token is over, so a
    request waiting for them is admitted at the next step, not in the same one."""
    eng, _ = engine(capacity_blocks=3)
    eng.submit(Request("a", list(range(8)), max_output_tokens=3))  # 2 blocks, a 3rd for decode
    eng.submit(Request("b", list(range(100, 108))))  # 2 blocks: waits for a's
    loads = []
    for _ in range(4):
        finished = eng.step().finished
        load = eng.load(0)
        loads.append((finished, load.running_requests, load.waiting_requests))
    assert loads == [([], 1, 1), ([], 1, 1), (["a"], 0, 1), (["b"], 0, 0)]


def test_the_newest_request_short_of_a_block_is_preempted_not_left_holding_its_own() -> None:
    """Two requests need a block for their next token and one is free: the older gets it and
    the newer, the newest running, is preempted (its blocks freed, it waits at the head), as
    vLLM does; it does not idle while keeping its blocks."""
    eng, _ = engine(capacity_blocks=5)
    eng.submit(Request("a", list(range(7)), max_output_tokens=8))  # 7 tokens: 2 blocks each
    eng.submit(Request("b", list(range(100, 107)), max_output_tokens=8))
    for _ in range(2):
        eng.step()
    assert (eng.load(0).running_requests, eng.caches[0].free_blocks) == (2, 1)
    eng.step()  # both reach token 9: a third block each
    load = eng.load(0)
    assert (eng.metrics().preemptions, load.running_requests, load.waiting_requests) == (1, 1, 1)
    assert eng.caches[0].used_blocks == 3  # a's own; b's two are cached, unreferenced
    drain(eng)
    assert eng.metrics().finished == 2


def test_lora_requests_hash_apart_and_pass_lora_through() -> None:
    """The same prompt under a LoRA gets other hashes, and BlockStored carries the LoRA."""
    eng, (sink,) = engine(cache_decode_blocks=False)
    eng.submit(Request("a", list(range(4))))
    eng.submit(Request("b", list(range(4)), lora_id=3, lora_name="ad"))
    drain(eng)
    plain, lora = stores(sink)[0], stores(sink)[1]
    assert plain.block_hashes != lora.block_hashes
    assert (lora.lora_id, lora.lora_name) == (3, "ad")
    assert eng.cached_prefix_blocks(list(range(4)), 0, lora_name="ad") == 1


def test_reset_cache_clears_when_idle_only() -> None:
    """reset_cache is refused while requests run, and publishes AllBlocksCleared when idle."""
    eng, _ = engine()
    eng.submit(Request("a", list(range(8)), max_output_tokens=3))
    eng.step()
    assert not eng.reset_cache()
    drain(eng)
    assert eng.reset_cache()
    assert eng.step().batches[0].events == [AllBlocksCleared()]
    assert eng.cached_blocks(0) == set()


def test_virtual_time_is_reproducible() -> None:
    """Two runs of the same workload publish byte-identical batches, ts included."""

    def run() -> list[bytes]:
        eng, (sink,) = engine(capacity_blocks=12, cpu_capacity_blocks=6)
        for i in range(6):
            eng.submit(Request(f"r{i}", [i % 3] * 9 + [i], max_output_tokens=5))
        drain(eng)
        return [msgspec.msgpack.encode(b) for b in sink.batches]

    first = run()
    assert first == run() and len(first) > 3


def test_real_time_clock_stamps_batches() -> None:
    """With a wall clock, batches carry wall-clock ts instead of virtual time."""
    cfg = EngineConfig(block_size=BS)
    sink = RecordingSink()
    eng = SimulatedEngine(cfg, publishers=[sink], clock=time.time)
    before = time.time()
    eng.submit(Request("a", list(range(4))))
    eng.step()
    assert sink.batches[0].ts >= before and eng.metrics().virtual_time == 0.0


class FakePublisher(RecordingSink):
    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_publisher_factory_builds_one_owned_publisher_per_rank() -> None:
    """The factory gets (rank, world_size); the engine starts and shuts down what it built."""
    built: list[FakePublisher] = []

    def factory(rank: int, world_size: int) -> FakePublisher:
        assert world_size == 2
        built.append(FakePublisher(rank))
        return built[-1]

    with SimulatedEngine(EngineConfig(block_size=BS, ranks=2), publisher_factory=factory) as eng:
        eng.submit(Request("a", list(range(4))), rank=1)
        eng.step()
    assert [p.rank for p in built] == [0, 1] and len(built[1].batches) == 1
    assert all(p.calls == ["start", "shutdown"] for p in built)


def test_publishers_must_match_ranks() -> None:
    """A wrong number of publishers is a configuration error naming both counts."""
    with pytest.raises(ValueError, match="1 publishers for 2 ranks"):
        SimulatedEngine(EngineConfig(ranks=2), publishers=[RecordingSink()])


def test_request_records_carry_virtual_times_and_hits() -> None:
    """Finished requests record rank, cached tokens and step-end times for TTFT."""
    eng, _ = engine(max_num_batched_tokens=8, step_base_s=1.0, step_token_s=0.0)
    eng.submit(Request("a", list(range(20)), max_output_tokens=3))
    drain(eng)
    eng.submit(Request("b", list(range(20)), max_output_tokens=1), rank=0)
    drain(eng)
    a, b = eng.finished_requests
    assert (a.request_id, a.rank, a.cached_tokens, a.output_tokens) == ("a", 0, 0, 3)
    assert (a.submitted_at, a.first_token_at, a.finished_at) == (0.0, 3.0, 5.0)
    assert a.time_to_first_token == 3.0
    assert b.cached_tokens == 16 and b.time_to_first_token == 1.0  # blocks before the last token
