"""The routing evaluation's yardsticks: the infinite-cache bound and the pooled-cache reference."""

from __future__ import annotations

from kvevents.sim._cluster import ClusterConfig
from kvevents.sim._evaluate import evaluate, format_table
from kvevents.sim._simulate import SimulationConfig
from kvevents.sim._trace import TraceRow, default_trace_path, load_trace
from kvevents.sim._yardsticks import infinite_cache_reuse, pooled_cache_reuse, pooled_config

SMALL = ClusterConfig(
    workers=4, capacity_blocks=512, max_num_batched_tokens=2048, transport="direct"
)


def test_infinite_cache_counts_every_earlier_block_once_computed() -> None:
    """Shared leading trace blocks count as cached, whole engine blocks only, in arrival order."""
    rows = [
        TraceRow(timestamp=0, input_length=1024, output_length=4, hash_ids=[1, 2]),
        TraceRow(timestamp=10, input_length=1536, output_length=4, hash_ids=[1, 2, 3]),
        TraceRow(timestamp=20, input_length=1024, output_length=4, hash_ids=[1, 4]),
        TraceRow(timestamp=30, input_length=1024, output_length=4, hash_ids=[1, 2]),
    ]
    reuse = infinite_cache_reuse(rows, SMALL)
    # row 2 reuses 1024 tokens, row 3 512, row 4 all its blocks but the last (it holds the
    # last token, which is computed again): 960.
    assert reuse == (1024 + 512 + 960) / (1024 + 1536 + 1024 + 1024)


def test_requests_no_rank_can_hold_are_left_out_as_the_engines_do() -> None:
    """A request larger than one rank's cache counts in neither the bound nor the reference."""
    tiny = ClusterConfig(
        workers=2, capacity_blocks=16, max_num_batched_tokens=512, transport="direct"
    )
    rows = [
        TraceRow(timestamp=0, input_length=512, output_length=1, hash_ids=[1]),
        TraceRow(
            timestamp=5, input_length=4096, output_length=1, hash_ids=[1, 2, 3, 4, 5, 6, 7, 8]
        ),
        TraceRow(timestamp=10, input_length=512, output_length=1, hash_ids=[1]),
    ]
    assert infinite_cache_reuse(rows, tiny) == 448 / 1024
    assert pooled_cache_reuse(rows, tiny) == 448 / 1024


def test_the_pooled_engine_holds_the_whole_cluster() -> None:
    """The reference engine has every rank's blocks, budget and sequence slots on one rank."""
    cluster = ClusterConfig(workers=4, ranks=2, capacity_blocks=100, max_num_batched_tokens=1000)
    pooled = pooled_config(cluster)
    assert (pooled.ranks, pooled.capacity_blocks, pooled.max_num_batched_tokens) == (1, 800, 8000)
    assert pooled.max_num_seqs == 8 * cluster.engine_config().max_num_seqs


def test_the_evaluation_prints_policies_against_both_references() -> None:
    """On a trace slice the bound >= the pooled reference >= round-robin, every policy has a
    "vs pooled" ratio, and the table ends with the two reference rows."""
    rows = load_trace(default_trace_path(), limit=200)
    config = SimulationConfig(cluster=SMALL)
    ev = evaluate(rows, ("round_robin", "longest_prefix"), config)
    assert ev.yardsticks is not None
    marks = ev.yardsticks
    assert marks.infinite_cache >= marks.pooled_cache >= ev.report("round_robin").reuse  # type: ignore[union-attr]
    assert (
        ev.ratio_to_pooled("longest_prefix")
        == ev.report("longest_prefix").reuse / marks.pooled_cache
    )  # type: ignore[union-attr]
    lines = format_table(ev).splitlines()
    assert lines[-2].startswith("bound: infinite cache") and lines[-1].startswith(
        "ref: pooled cache"
    )
    assert "vs pooled" in lines[0] and "busy max/mean" in lines[0]
    doc = ev.to_dict()
    assert doc["yardsticks"]["pooled_cache"] == marks.pooled_cache
    assert doc["policies"]["round_robin"]["busy_balance"] >= 1.0
