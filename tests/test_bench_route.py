"""The route rig's own pieces (bench/route_*.py): workloads, the client's records, the figures,
the partial record of bench/RESULTS.md and the chart; no engine, router or client is run."""

from __future__ import annotations

import json
import math
import random
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from harness import Row
from route_chart import route_svg
from route_client import Record, history_carries_answers, parse_record, sent_messages, strip_raw
from route_engines import REPO, Snapshot, _in_repo
from route_report import (
    FaultFigures,
    Outcome,
    fault_rows,
    outcome_rows,
    prediction_agreement,
    summary,
)
from route_workload import (
    _WORDS,
    ChatShape,
    MooncakeShape,
    TextMaker,
    chat_records,
    chat_working_set_blocks,
    lru_hit_fraction,
    mooncake_records,
    mooncake_working_set_blocks,
)
from run import merge, render

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def maker(tmp_path_factory: pytest.TempPathFactory) -> TextMaker:
    """A word-level tokenizer over the workload's words: one token per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(dict.fromkeys([*_WORDS, "[UNK]"]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return TextMaker(path)


def test_text_is_as_long_as_asked_and_starts_with_its_lead(maker: TextMaker) -> None:
    """Text of n tokens has exactly n here (one token per word) and keeps its lead words."""
    text = maker.text(100, random.Random(1), lead="cache prefix")
    assert maker.count(text) == 100
    assert text.startswith("cache prefix ")


def test_chat_records_have_one_system_prompt_per_app_and_every_turn(maker: TextMaker) -> None:
    """Every conversation opens with its app's system prompt (shared within an app, distinct
    across apps), then its turns, each asking for the answer length of the shape."""
    shape = ChatShape(apps=3, system_tokens=40, conversations=12, turns=3, user_tokens=8)
    records = chat_records(shape, maker)
    assert len(records) == 12 and len({r["session_id"] for r in records}) == 12
    systems: dict[str, set[str]] = {}
    for record in records:
        system, *turns = record["turns"]
        assert system["role"] == "system" and len(turns) == 3
        assert all(t["output_length"] == shape.answer_tokens for t in turns)
        systems.setdefault(record["session_id"].split("-")[0], set()).add(system["text"])
    assert all(len(texts) == 1 for texts in systems.values())
    assert len({next(iter(t)) for t in systems.values()}) == len(systems)


def test_chat_working_set_counts_system_prompts_and_live_histories() -> None:
    """Working set: every app's system prompt, plus each concurrent conversation's own
    history at its longest, in whole blocks."""
    shape = ChatShape(
        apps=2, system_tokens=59, turns=2, user_tokens=10, answer_tokens=6, concurrency=3
    )
    # system: ceil((59 + 5) / 32) = 2 blocks per app; private: 5 + 1 + 2 * (10 + 6 + 10) = 58
    assert chat_working_set_blocks(shape, 32) == 2 * 2 + 3 * math.ceil(58 / 32)


def test_mooncake_rows_keep_whole_prefix_groups_capped() -> None:
    """Sampled rows come in whole prefix groups (each at least twice), in trace order, with
    capped blocks and outputs and every block full."""
    shape = MooncakeShape(groups=6, max_blocks=10, output_tokens=5, window=800)
    records = mooncake_records(shape, 32)
    firsts = [r["hash_ids"][0] for r in records]
    assert len(set(firsts)) == 6
    assert all(firsts.count(f) >= 2 for f in firsts)
    assert all(len(r["hash_ids"]) <= 10 for r in records)
    assert all(r["input_length"] == 32 * len(r["hash_ids"]) for r in records)
    assert all(1 <= r["output_length"] <= 5 for r in records)
    assert mooncake_working_set_blocks(records) >= 6


def test_lru_yardstick_hits_only_reused_prefixes_within_capacity() -> None:
    """A repeated prompt hits in full when it fits, not at all once evicted, and a prompt
    sharing only a later block gets no hit (prefix hits only)."""
    assert lru_hit_fraction([[1, 2], [1, 2]], capacity=2) == 0.5
    assert lru_hit_fraction([[1, 2], [3, 4], [1, 2]], capacity=2) == 0.0
    assert lru_hit_fraction([[1, 2], [9, 2]], capacity=10) == 0.0


def _line(error: dict | None = None, **metrics: float) -> str:
    meta = {"conversation_id": "c1", "turn_index": 2, "request_start_ns": 2_000_000_000}
    data = {"metadata": meta, "metrics": {k: {"value": v} for k, v in metrics.items()}}
    if error is not None:
        data["error"] = error
    return json.dumps(data)


def test_client_records_give_usage_ttft_and_error_kinds() -> None:
    """aiperf's records: cached and prompt tokens and TTFT from usage; an HTTP error's code,
    else the client's own error type."""
    ok = parse_record(
        _line(time_to_first_token=12.5, usage_prompt_tokens=100, usage_prompt_cache_read_tokens=64)
    )
    assert (ok.conversation, ok.turn, ok.start_s) == ("c1", 2, 2.0)
    assert (ok.ttft_ms, ok.prompt_tokens, ok.cached_tokens, ok.error) == (12.5, 100, 64, None)
    assert parse_record(_line({"code": 500, "type": "Internal Server Error"})).error == "HTTP 500"
    assert (
        parse_record(_line({"code": None, "type": "ClientConnectorError"})).error
        == "ClientConnectorError"
    )


def test_history_check_needs_every_earlier_answer() -> None:
    """A later turn must carry one non-empty assistant message per earlier turn."""
    first = ("c", 0, [{"role": "user", "content": "q0"}])
    good = (
        "c",
        1,
        [
            {"role": "user", "content": "q0"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q1"},
        ],
    )
    lost = ("c", 1, [{"role": "user", "content": "q1"}])
    assert history_carries_answers([first, good])
    assert not history_carries_answers([first, lost])
    assert not history_carries_answers([first])


def _outcome() -> Outcome:
    lines = [
        _line(time_to_first_token=10, usage_prompt_tokens=100, usage_prompt_cache_read_tokens=50),
        _line(time_to_first_token=30, usage_prompt_tokens=100, usage_prompt_cache_read_tokens=100),
        _line({"code": 502, "type": "Bad Gateway"}),
    ]
    engines = [Snapshot(200, 150, 3, 0), Snapshot(0, 0, 1, 0)]
    return Outcome("r", "chat", records=[parse_record(x) for x in lines], engines=engines)


def test_outcome_figures_from_usage_counters_and_errors() -> None:
    """Cached fraction over the successful requests' usage, the engines' hit fraction, max/mean
    requests per engine, and errors by kind."""
    outcome = _outcome()
    assert outcome.cached_fraction() == 0.75
    assert outcome.engine_hit_fraction() == 0.75
    assert outcome.balance() == 1.5
    assert outcome.errors() == {"HTTP 502": 1}
    rows = {r.metric: r for r in outcome_rows("s", outcome, pooled=0.8)}
    assert rows["share of pooled"].value == pytest.approx(93.75)
    assert rows["errors (HTTP 502: 1)"].value == 1.0
    assert "balance, max/mean (requests 3/1)" in rows


def test_a_router_that_did_not_run_is_one_row_saying_why() -> None:
    """Not installed or failed: a row naming the reason, not a silent gap."""
    rows = outcome_rows("s", Outcome("peer", "chat", "not installed (pip failed)"), None)
    assert [r.case for r in rows] == ["peer: not installed (pip failed)"]


def test_prediction_agreement_reads_the_front_doors_counters() -> None:
    """exact and eviction races of compared predictions from kvevents route's planner
    counters, summed over several runs' texts; None without."""
    text = (
        "# TYPE kvevents_route_planner_compared_total counter\n"
        "kvevents_route_planner_compared_total 100.0\n"
        "kvevents_route_planner_exact_total 90.0\n"
        "kvevents_route_planner_evicted_total 8.0\n"
        "kvevents_route_planner_exact_keys 5.0\n"
    )
    assert prediction_agreement(text) == (90.0, 8.0, 100.0)
    assert prediction_agreement(text + "\n" + text) == (180.0, 16.0, 200.0)
    assert prediction_agreement("vllm:num_requests_running 0\n") is None


def test_a_routers_runs_are_reported_together_with_each_runs_figure() -> None:
    """merged(): a router's repeated runs become one outcome (requests together, engine
    counters summed), its rows the figures of all of them and each run's cached fraction."""
    from route_report import merged

    def record(cached: int) -> Record:
        return Record("c", 0, 0.0, 1.0, 10.0, 100, cached, None)

    runs = [
        Outcome("r", "chat", records=[record(80)], engines=[Snapshot(10, 8, 1, 100)]),
        Outcome("p", "chat", records=[record(90)], engines=[Snapshot(10, 9, 1, 100)]),
        Outcome("r", "chat", records=[record(60)], engines=[Snapshot(10, 6, 1, 100)]),
    ]
    together = merged(runs)
    assert [o.router for o in together] == ["r", "p"]
    assert together[0].runs == [0.8, 0.6] and together[1].runs == []
    assert together[0].cached_fraction() == 0.7
    assert together[0].engines == [Snapshot(20, 14, 2, 200)]
    rows = {r.metric: r.value for r in outcome_rows("s", together[0], 0.9)}
    assert rows["cached fraction (usage)"] == 70.0
    assert rows["cached fraction, lowest of 2 runs (80.0, 60.0)"] == 60.0
    assert rows["cached fraction, highest of 2 runs"] == 80.0


def test_partial_record_replaces_its_sections_and_keeps_the_rest() -> None:
    """--record: the named module's sections replace the old ones, with a note; the others stay."""
    old = render(
        [Row("keep", "a", "m", 1.0, ""), Row("route", "b", "m", 2.0, "")], "# Benchmark results"
    )
    new = merge(old, [Row("route", "b", "m", 3.0, ""), Row("route new", "c", "m", 4.0, "")], "NOTE")
    assert "### keep" in new and "| a | m | 1.00" in new
    assert "| b | m | 2.00" not in new and "| b | m | 3.00" in new
    assert new.count("### route\n") == 1 and "### route new" in new
    assert new.count("NOTE") == 2 and new.startswith("# Benchmark results")


def test_route_chart_has_a_bar_per_router_and_names_the_skipped() -> None:
    """One bar per router that ran (its cached fraction), the ones that did not, in words."""
    section = "Routers on 3 vLLM CPU engines: chat"
    rows = [
        Row(section, "pooled cache (reference)", "cached fraction (usage)", 88.0, "%"),
        Row(section, "vllm-router kv_aware", "cached fraction (usage)", 60.0, "%"),
        Row(section, "vllm-router kv_aware", "TTFT p99", 120.0, "ms"),
        Row(section, "kvevents route (default): not available yet", "ran", 0.0, ""),
    ]
    root = ET.fromstring(route_svg(rows, "t"))
    titles = [r.find(f"{SVG}title") for r in root.iter(f"{SVG}rect")]
    bars = [t.text for t in titles if t is not None]
    assert bars == ["pooled cache (reference): 88.0%", "vllm-router kv_aware: 60.0%"]
    texts = "".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "not available yet" in texts and "TTFT p99 120 ms" in texts


def test_front_door_headers_give_the_engine_and_the_per_request_agreement() -> None:
    """With the HTTP trace, each record carries the router's x-kvevents headers (any case);
    agreement counts the successful requests whose prediction equals the engine's figure."""

    def traced(predicted: str, cached: int) -> str:
        data = json.loads(_line(usage_prompt_tokens=64, usage_prompt_cache_read_tokens=cached))
        headers = {"X-KVEvents-Engine": "e1", "x-kvevents-predicted-cached-tokens": predicted}
        data["trace_data"] = {"response_headers": headers}
        return json.dumps(data)

    records = [parse_record(traced("32", 32)), parse_record(traced("32", 0)), parse_record(_line())]
    assert (records[0].engine, records[0].predicted_cached) == ("e1", 32)
    assert records[2].predicted_cached is None
    outcome = Outcome("kvevents route (default)", "chat", records=records, engines=[Snapshot()])
    assert outcome.header_agreement() == (1, 2)
    assert Outcome("peer", "chat", records=[records[2]]).header_agreement() is None


def test_the_engines_record_names_paths_in_the_checkout_relative_to_it() -> None:
    """An engine's command is recorded with paths inside the checkout relative to it (the
    record reads the same on another machine); other arguments stay as they were."""
    inside = str(REPO / ".venv-vllm" / "bin" / "python")
    assert _in_repo(inside) == ".venv-vllm/bin/python"
    assert _in_repo("/usr/bin/python3") == "/usr/bin/python3"
    assert _in_repo("--block-size") == "--block-size"


def test_a_raw_export_cut_off_mid_line_is_stripped_and_read_around(tmp_path: Path) -> None:
    """A client killed mid-write (the fault run) leaves a line cut off: the rest is stripped
    of its streamed chunks and read; that line is kept as it is and skipped, not fatal."""
    whole = {
        "metadata": {"conversation_id": "c1", "turn_index": 1},
        "payload": {"messages": [{"role": "user", "content": "hi"}]},
        "responses": ["chunk"] * 3,
    }
    raw = tmp_path / "profile_export_raw.jsonl"
    raw.write_text(json.dumps(whole) + "\n" + '{"metadata": {"conversation_id": "c2", "tu\n')
    assert strip_raw(tmp_path) == 1
    lines = raw.read_text().splitlines()
    assert "responses" not in json.loads(lines[0]) and lines[1].startswith('{"metadata"')
    assert sent_messages(tmp_path) == [("c1", 1, [{"role": "user", "content": "hi"}])]


def _record(start: float, cached: int, error: str | None = None) -> Record:
    return Record("c", 0, start, start + 1, 10.0, 64, cached, error)


def test_the_fault_run_says_when_the_engine_was_not_back_while_the_client_ran() -> None:
    """A restart that did not finish while the client's traffic ran: the down time runs to
    the run's end, nothing counts as after the restart, and the front door's continued
    streams are reported from its /metrics."""
    records = [_record(10.0, 32), _record(20.0, 0)]
    figures = FaultFigures(killed_at=45.0, restarted_at=50.0, ready_at=None, victim="e0")
    outcome = Outcome(
        "kvevents route (default)",
        "fault",
        records=records,
        engines=[Snapshot()],
        seconds=300.0,
        router_metrics="kvevents_route_continued_total 2.0\nkvevents_route_truncated_total 0.0\n",
        fault=figures,
    )
    rows = {row.metric: row.value for row in fault_rows("s", outcome)}
    down = "engine down (killed at 45 s, not back before the client's run ended at 300 s)"
    assert rows[down] == 255.0
    assert rows["streams continued on another engine"] == 2.0
    assert math.isnan(rows["cached fraction after the restart (0 requests)"])
    assert summary([outcome])[0]["fault"]["ready_at_s"] is None
    back = FaultFigures(45.0, 50.0, 120.0, "e0", after_restart=[_record(130.0, 48)])
    outcome = Outcome("peer", "fault", records=records, engines=[Snapshot()], fault=back)
    rows = {row.metric: row.value for row in fault_rows("s", outcome)}
    assert rows["engine down (killed at 45 s, back at 120 s)"] == 75.0
    assert rows["cached fraction after the restart (1 requests)"] == 75.0
    assert "streams continued on another engine" not in rows


def test_the_simulator_is_set_against_the_mean_of_every_run() -> None:
    """A pair run more than once gets the mean of its simulated and real cached fractions
    (each run's real figure listed); a pair run once gets no mean row."""
    from route_sim import mean_rows

    runs = {"a vs simulated p": [(0.80, 0.70), (0.90, 0.74), (0.85, 0.72)], "b": [(0.5, 0.5)]}
    (row,) = mean_rows("S", runs)
    assert row.case == "a vs simulated p" and row.unit == "%"
    assert row.metric == "cached fraction, simulated, mean of 3 runs (real 70.0, 74.0, 72.0)"
    assert math.isclose(row.value, 85.0) and math.isclose(row.baseline or 0, 72.0)


def test_the_step_probe_reads_a_prefill_and_a_decode_step_from_a_streamed_answer() -> None:
    """measure_step_times against a stand-in engine that waits 0.3 s before its answer and
    0.05 s between its tokens: a step of about 0.05 s, and the rest of the first token's
    wait spread over the prompt's tokens; the simulator is then given that step time."""
    from kvevents.testing.openai_engine import Behaviour, StandInEngine
    from route_sim import SimShape, StepTimes, measure_step_times

    behaviour = Behaviour(delay=0.3, tokens=5, token_delay=0.05)
    with StandInEngine(models=("m",), behaviour=behaviour).start() as engine:
        steps = measure_step_times(engine.url, "m", 100, prompt_tokens=100, tries=3)
    assert 0.04 <= steps.base_s < 0.2
    assert 0.15 <= steps.token_s * 100 < 0.6
    shape = SimShape(3, 10, 16, 2048, 4, 8, steps)
    cluster = shape.config(3, 10).cluster
    assert (cluster.step_base_s, cluster.step_token_s) == (steps.base_s, steps.token_s)
    assert SimShape(3, 10, 16, 2048, 4, 8).steps == StepTimes.simulator()
    assert steps.label().startswith(f"steps of {steps.base_s * 1e3:.1f} ms + ")


def test_the_simulated_turns_answer_with_the_engines_answers() -> None:
    """Each turn answers with the tokens the next turn's prompt holds right after its own
    prompt (the engine's answer, as sent back); a last turn, or one whose next prompt does not
    go on from it, keeps the simulator's own tokens."""
    from kvevents.sim import Request
    from route_sim import with_answers

    first = Request("c/0", [1, 2, 3], max_output_tokens=2)
    second = Request("c/1", [1, 2, 3, 7, 8, 9, 4, 5], max_output_tokens=2)
    third = Request("c/2", [6, 6, 6, 6, 6, 6, 6, 6, 6], max_output_tokens=2)
    turns = with_answers([first, second, third])
    assert [t.output_token_ids for t in turns] == [(7, 8), (), ()]
    assert [t.token_ids for t in turns] == [first.token_ids, second.token_ids, third.token_ids]


def test_the_engines_phases_are_counted_per_run() -> None:
    """An engine's snapshot takes vLLM's phase histograms (sums and the requests they cover)
    and generated tokens; a run's difference of two snapshots is per engine, as summary.json
    keeps it."""
    from route_engines import SNAPSHOT_METRICS, engine_phases

    before = Snapshot(*range(len(SNAPSHOT_METRICS)))
    after = before + Snapshot(10, 8, 2, 100, 0.5, 1.5, 6.0, 2, 64)
    (phases,) = engine_phases([after - before])
    assert phases == {
        "requests": 2,
        "output_tokens": 64,
        "queue_s": 0.5,
        "prefill_s": 1.5,
        "decode_s": 6.0,
    }
    assert SNAPSHOT_METRICS[4:8] == (
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
        "vllm:request_decode_time_seconds_count",
    )


def test_the_simulator_is_timed_as_the_engines_ran() -> None:
    """From a real run's phases per engine and the client's records, set against the same
    prompts simulated: each engine's speed is its time per generated token after the first
    over the simulated engines', and the first-token delay is the client's mean time to
    first token less the engines' mean time waiting and prefilling. None without phases."""
    from types import SimpleNamespace

    from route_sim import loaded_timing

    # Simulated: two requests, 33 tokens each, 32 after the first in 0.16 s: 5 ms a token.
    answer = SimpleNamespace(output_tokens=33, first_token_at=0.04, finished_at=0.2)
    simulated = SimpleNamespace(finished=(answer, answer))
    records = [
        Record("c", 0, 0.0, 1.0, ttft_ms=ms, prompt_tokens=100, cached_tokens=0, error=None)
        for ms in (500.0, 700.0)
    ]
    phases = [
        # 10 requests, 320 tokens after the first in 6.4 s: 20 ms a token (x4); 0.2 s waiting
        # and prefilling each.
        {"requests": 10, "output_tokens": 330, "queue_s": 1.0, "prefill_s": 1.0, "decode_s": 6.4},
        # 10 requests, 10 ms a token (x2); 0.4 s each.
        {"requests": 10, "output_tokens": 330, "queue_s": 3.0, "prefill_s": 1.0, "decode_s": 3.2},
    ]
    outcome = Outcome("r", "chat", records=records, extra={"engine_phases": phases})
    timing = loaded_timing(outcome, simulated)  # type: ignore[arg-type]
    assert timing is not None
    assert [round(s, 6) for s in timing.speeds] == [4.0, 2.0]
    assert math.isclose(timing.first_token_delay, 0.6 - 0.3)  # 600 ms at the client, 300 inside
    assert timing.label() == "as the engines ran (steps x4.0/2.0, first tokens 300 ms late)"
    assert loaded_timing(Outcome("r", "chat", records=records), simulated) is None  # type: ignore[arg-type]
