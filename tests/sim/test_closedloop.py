"""Closed-loop multi-turn chat over the simulated cluster (kvevents.sim.closedloop)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvevents.sim import ClusterConfig, LoadView, Request, SimulationConfig, run_conversations

BLOCK = 16


def _config(workers: int, blocks: int = 4096) -> SimulationConfig:
    cluster = ClusterConfig(
        workers=workers, block_size=BLOCK, capacity_blocks=blocks, transport="direct"
    )
    return SimulationConfig(cluster=cluster)


def _conversations(count: int, turns: int, apps: int = 2, seed: int = 0) -> list[list[Request]]:
    """Chats over ``apps`` shared system prompts; each turn's prompt extends the last one's."""
    rng = random.Random(seed)
    systems = [[rng.randrange(30000) for _ in range(8 * BLOCK)] for _ in range(apps)]
    out = []
    for c in range(count):
        history = list(systems[c % apps])
        conversation = []
        for t in range(turns):
            history += [rng.randrange(30000) for _ in range(2 * BLOCK)]
            conversation.append(Request(f"c{c}/t{t}", list(history), 4))
            history += [rng.randrange(30000) for _ in range(BLOCK)]
        out.append(conversation)
    return out


def test_every_turn_is_sent_once_after_the_previous_answer() -> None:
    """Each conversation's turns are served once, in order, each submitted once the previous
    one had finished."""
    run = run_conversations(_conversations(6, 3), "round_robin", _config(2), concurrency=3)
    assert run.report.requests == 18 and run.report.rejected == 0
    times = {r.request_id: (r.submitted_at, r.finished_at) for r in run.finished}
    assert len(times) == 18 == len(run.finished)
    for c in range(6):
        for t in range(1, 3):
            assert times[f"c{c}/t{t}"][0] >= times[f"c{c}/t{t - 1}"][1]


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_no_more_conversations_in_flight_than_the_concurrency(concurrency: int) -> None:
    """At any instant at most ``concurrency`` requests are between submission and end, and
    with enough conversations exactly that many run at once."""
    run = run_conversations(
        _conversations(8, 2), "round_robin", _config(2), concurrency=concurrency
    )
    edges = sorted(
        [(r.submitted_at, 1) for r in run.finished] + [(r.finished_at, -1) for r in run.finished],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    live = peak = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    assert peak == concurrency


def test_later_turns_hit_their_history_on_one_engine() -> None:
    """On one engine with room for everything, a conversation's later turns are served from
    cache up to the previous turn's prompt, and the system prompt is shared across apps'
    conversations: the reuse is at least that."""
    conversations = _conversations(4, 3, apps=1)
    run = run_conversations(conversations, "round_robin", _config(1), concurrency=1)
    by_id = {r.request_id: r for r in run.finished}
    for c in range(4):
        for t in range(1, 3):
            previous = len(conversations[c][t - 1].token_ids) // BLOCK * BLOCK
            assert by_id[f"c{c}/t{t}"].cached_tokens >= previous
    assert by_id["c1/t0"].cached_tokens >= 8 * BLOCK


def test_own_in_flight_load_spreads_a_burst_the_engines_have_not_seen() -> None:
    """prefix_load with the router's own view: requests sent together at the start, before
    any engine stepped, are booked as they are sent, so they spread over the engines."""
    conversations = _conversations(4, 1, apps=4)
    run = run_conversations(
        conversations, "prefix_load", _config(4), concurrency=4, load_view="inflight"
    )
    assert sorted(run.report.per_target.values()) == [1, 1, 1, 1]


def test_own_view_credits_the_blocks_of_requests_in_flight_to_their_engine() -> None:
    """With the router's own view, as the front door does, a burst sharing a prefix no engine
    has stored yet follows the first request sent (its predicted blocks); the engines' true
    view has nothing cached yet and spreads the burst by load."""
    conversations = _conversations(4, 1, apps=1)
    own = run_conversations(
        conversations, "longest_prefix", _config(4), concurrency=4, load_view="inflight"
    )
    true = run_conversations(
        conversations, "longest_prefix", _config(4), concurrency=4, load_view="engine"
    )
    assert max(own.report.per_target.values()) == 4
    assert max(true.report.per_target.values()) < 4


@pytest.mark.parametrize("view", ["engine", "inflight"])
def test_bounded_prefix_is_given_requests_in_flight(view: LoadView) -> None:
    """bounded_prefix sees each engine's requests in flight, in both views. A burst sharing
    one new prefix: with the front door's own view (its requests' blocks predicted where they
    went) it stays on one engine up to the bound (ceil(mean) + 8 here: 13), then spills over
    to another; with the engines' true load (nothing cached yet anywhere) every request ties
    at no match and goes where the fewest are in flight."""
    conversations = _conversations(18, 1, apps=1)
    run = run_conversations(
        conversations, "bounded_prefix", _config(3), concurrency=18, load_view=view
    )
    expected = [6, 6, 6] if view == "engine" else [0, 5, 13]
    assert sorted(run.report.per_target.values()) == expected


def test_a_slower_engine_keeps_requests_in_flight_longer_and_serves_fewer() -> None:
    """``speeds``: an engine three times slower than the others holds its requests longer, so
    a policy weighing requests in flight sends it fewer (round robin, blind to load, not)."""
    conversations = _conversations(24, 3, apps=12)
    bounded = {
        speeds: run_conversations(
            conversations,
            "bounded_prefix",
            _config(3),
            concurrency=6,
            load_view="inflight",
            speeds=speeds,
        ).report.per_target
        for speeds in ((), (3.0, 1.0, 1.0))
    }
    even, slow = (sorted(b.items()) for b in bounded.values())
    assert slow[0][1] < even[0][1] and slow[0][1] < min(n for _, n in slow[1:])
    blind = run_conversations(
        conversations, "round_robin", _config(3), concurrency=6, speeds=(3.0, 1.0, 1.0)
    )
    assert sorted(blind.report.per_target.values()) == [24, 24, 24]


def test_bad_arguments_are_refused_by_name() -> None:
    """A non-positive concurrency, an unknown load view, speeds not one per worker or a first
    token delay that is negative or not finite is a ValueError naming it."""
    with pytest.raises(ValueError, match="concurrency"):
        run_conversations([], "round_robin", _config(1), concurrency=0)
    with pytest.raises(ValueError, match="load_view"):
        run_conversations([], "round_robin", _config(1), concurrency=1, load_view="psychic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speeds"):
        run_conversations([], "round_robin", _config(2), concurrency=1, speeds=(1.0,))
    for delay in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="first_token_delay"):
            run_conversations([], "round_robin", _config(1), concurrency=1, first_token_delay=delay)


def test_own_view_moves_a_request_from_prefill_to_held_at_its_first_token() -> None:
    """The router's own view books a request as the front door's in-flight loads do
    (``kvevents.route``'s InFlight, as tests/route/test_predict.py shows): its unmatched blocks queued
    for prefill until its first token comes out, then its prompt blocks held until it ends
    (not both for its whole life)."""
    from kvevents.sim._closedloop import _ClosedLoopRun, _InFlight
    from kvevents.sim._cluster import Cluster

    config = _config(1)
    with Cluster(config.cluster) as cluster:
        run = _ClosedLoopRun(cluster, "prefix_load", config, "inflight")
        (target,) = cluster.targets()
        run.in_flight = {
            "prefilling": _InFlight(target, new_blocks=3, held_blocks=5),
            "answering": _InFlight(target, new_blocks=2, held_blocks=4, answering=True),
        }
        run._update_loads()
        simulated = run.router.loads.get(*target)
    assert (simulated.queued_blocks, simulated.active_blocks, simulated.requests) == (3, 4, 2)


def test_the_engine_says_whose_first_token_came_out() -> None:
    """SimulatedEngine.first_tokens: each request's id once, when the step that made its
    first token ends (what the closed loop reads to move it from prefill to held)."""
    from kvevents.sim import EngineConfig, SimulatedEngine

    config = EngineConfig(block_size=BLOCK, capacity_blocks=64, max_num_batched_tokens=2 * BLOCK)
    engine = SimulatedEngine(config)
    engine.submit(Request("long", list(range(6 * BLOCK)), 3))  # prefill: 3 steps of 2 blocks
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(list(engine.first_tokens))
    assert seen == [[], [], ["long"], ["long"], ["long"]]


def test_without_a_delay_the_router_sees_each_answer_as_the_engine_makes_it() -> None:
    """first_token_delay 0 (the default): every request is seen answering and ending at the
    engine's own first token and end."""
    run = run_conversations(_conversations(6, 3), "prefix_load", _config(2), concurrency=3)
    assert {r.request_id: (r.first_token_at, r.finished_at) for r in run.finished} == run.seen


def test_first_tokens_are_seen_late_and_the_next_turn_waits_for_the_answer_seen() -> None:
    """With a delay, each first token is seen after the engine made it, by the given mean
    over many requests (seeded: the same every run); an answer is seen to end no earlier than
    its first token; a conversation's next turn goes out only once its answer was seen."""
    conversations = _conversations(30, 4)
    run = run_conversations(
        conversations, "prefix_load", _config(2), concurrency=4, first_token_delay=0.2, seed=3
    )
    records = {r.request_id: r for r in run.finished}
    assert run.seen.keys() == records.keys()
    late = []
    for request_id, (first, end) in run.seen.items():
        record = records[request_id]
        assert first >= record.first_token_at
        assert end == max(record.finished_at, first)
        late.append(first - record.first_token_at)
    assert 0.15 < sum(late) / len(late) < 0.25
    again = run_conversations(
        conversations, "prefix_load", _config(2), concurrency=4, first_token_delay=0.2, seed=3
    )
    assert again.seen == run.seen
    for c in range(30):
        for t in range(1, 4):
            assert records[f"c{c}/t{t}"].submitted_at >= run.seen[f"c{c}/t{t - 1}"][1]


def test_an_answer_that_ended_before_its_first_token_was_seen_is_never_seen_answering() -> None:
    """The in-flight view moves a request from prefilling to answering when its first token
    is seen, not when the engine made it; one whose answer ended before that is seen whole:
    it leaves the view without ever counting as answering."""
    from kvevents.sim._closedloop import _Delivery, _InFlight
    from kvevents.sim._records import RequestRecord

    answered: list[float] = []
    client = SimpleNamespace(answered=lambda at, conversation, turn: answered.append(at))
    flight = _InFlight(("w0", 0), new_blocks=2, held_blocks=5)
    run = SimpleNamespace(in_flight={"r": flight})
    delivery = _Delivery(run, client, {"r": (0, 0)}, delay=10.0, seed=0)  # type: ignore[arg-type]
    delivery.first_token("r", 1.0)
    delivery.finished(RequestRecord("r", 0, 160, 0, 4, 0.5, 1.0, 1.2))
    first, end = delivery.seen["r"]
    assert first > 1.2 and end == first  # seen whole, after the engine ended it
    assert delivery.next_time() == first
    delivery.due()  # the first token seen: answering, as the front door would see it
    assert flight.answering and not answered
    delivery.due()  # then its end, at the same instant
    assert "r" not in run.in_flight and answered == [first]
    assert delivery.next_time() == float("inf")


def test_prefix_load_keeps_more_requests_on_their_prefix_when_first_tokens_are_seen_late() -> None:
    """prefix_load's decode term is the prompt blocks of the requests seen answering: seen
    late (as on loaded engines, whose servers hand tokens out late), fewer count, and more
    requests stay on the engine holding their prefix: more served from cache, less evenly
    spread. bounded_prefix, which weighs requests in flight and not answers, hardly moves."""
    conversations = _conversations(36, 4, apps=4, seed=1)

    def run(policy: str, delay: float) -> tuple[float, int]:
        report = run_conversations(
            conversations,
            policy,
            _config(3, blocks=60),
            concurrency=6,
            load_view="inflight",
            first_token_delay=delay,
        ).report
        return report.reuse, max(report.per_target.values())

    (prompt, busiest), (late, busiest_late) = run("prefix_load", 0.0), run("prefix_load", 0.5)
    assert late > prompt + 0.02 and busiest_late > busiest
    assert abs(run("bounded_prefix", 0.5)[0] - run("bounded_prefix", 0.0)[0]) < 0.01
