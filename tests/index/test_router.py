"""Routing policies and explainable decisions (kvevents.index._router)."""

from __future__ import annotations

import pytest

from kvevents.index._decision import Load, LoadBook
from kvevents.index._keys import block_hashes
from kvevents.index._prefix import PrefixIndex
from kvevents.index._router import Router, make_policy
from kvevents.testing.index import batch, store_event

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks


def make_router(policy: str = "prefix_load", **kwargs: object) -> Router:
    index = PrefixIndex(BS)
    for worker in ["a", "b", "c"]:
        index.register_worker(worker, block_size=BS)
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    index.apply("b", 0, batch(store_event(PROMPT, BS, end_block=6)))
    return Router(index, policy, **kwargs)  # type: ignore[arg-type]


def test_longest_prefix_picks_the_most_matched_blocks() -> None:
    """The worker with the longest cached prefix wins, and the decision says why."""
    decision = make_router("longest_prefix").route(PROMPT)
    assert decision.winner == ("b", 0)
    assert decision.matched == {("a", 0): 2, ("b", 0): 6, ("c", 0): 0}
    assert [s.score for s in decision.scores] == [2.0, 6.0, 0.0]
    assert decision.policy == "longest_prefix"


def test_longest_prefix_breaks_ties_by_load() -> None:
    """With equal matches the less loaded target wins."""
    router = make_router("longest_prefix")
    router.loads.set("a", queued_blocks=5)
    router.loads.set("b", active_blocks=1)
    assert router.route([9] * 8).winner == ("c", 0)


def test_prefix_load_trades_cache_hits_against_load() -> None:
    """A busy worker with the best prefix loses to an idle one once load outweighs reuse."""
    router = make_router("prefix_load")
    assert router.route(PROMPT).winner == ("b", 0)
    router.loads.set("b", queued_blocks=3)
    decision = router.route(PROMPT)
    # a: 6 new blocks; b: 2 new + 3 queued = 5; c: 8 new.
    assert decision.winner == ("b", 0)
    router.loads.set("b", queued_blocks=5)
    decision = router.route(PROMPT)
    assert decision.winner == ("a", 0)
    terms = {(s.worker_id, s.rank): s.terms for s in decision.scores}
    assert terms[("b", 0)] == {"new_blocks": 2, "prefill_cost": 7.0, "decode_cost": 0, "cost": 7.0}
    assert terms[("a", 0)]["cost"] == 6.0


def test_prefix_load_counts_active_blocks() -> None:
    """Decode load (active blocks) adds to the cost one for one."""
    router = make_router("prefix_load", prefill_weight=2.0)
    router.loads.set("b", active_blocks=9)
    decision = router.route(PROMPT)
    costs = {(s.worker_id, s.rank): -s.score for s in decision.scores}
    assert costs == {("a", 0): 12.0, ("b", 0): 13.0, ("c", 0): 16.0}
    assert decision.winner == ("a", 0)


def test_prefix_load_breaks_ties_by_matched_blocks_then_at_random() -> None:
    """Equal costs: more matched blocks wins, then a seeded draw among the tied targets."""
    router = make_router("prefix_load")
    router.loads.set("a", queued_blocks=4)  # a: 6 new + 4 queued = 10 = b: 2 new + 8 queued
    router.loads.set("b", queued_blocks=8)
    router.loads.set("c", queued_blocks=2)  # c: 8 new + 2 queued = 10, nothing matched
    assert router.route(PROMPT).winner == ("b", 0)
    assert router.route([9] * 32).winner == ("c", 0)  # no match anywhere: c is cheapest
    router.loads.set("c", queued_blocks=4)
    router.loads.set("b", queued_blocks=4)
    decision = router.route([9] * 32)  # all equal: drawn among the three
    assert decision.tied == 3 and decision.winner in {("a", 0), ("b", 0), ("c", 0)}
    assert "3 targets tie" in decision.reason and "drawn at random" in decision.explain()


@pytest.mark.parametrize("policy", ["prefix_load", "longest_prefix", "bounded_prefix"])
def test_ties_spread_evenly_and_reproducibly(policy: str) -> None:
    """Over many all-tied decisions each target wins about a third of the time (no hot spot
    on the first target), and the same seed gives the same sequence of winners."""
    index = PrefixIndex(BS)
    for worker in "abc":
        index.register_worker(worker, block_size=BS)

    def winners(seed: int) -> list[tuple[str, int] | None]:
        router = Router(index, policy, seed=seed)
        return [router.route(PROMPT).winner for _ in range(600)]

    first = winners(7)
    counts = {w: first.count((w, 0)) for w in "abc"}
    assert all(150 <= n <= 250 for n in counts.values()), counts
    assert winners(7) == first and winners(8) != first


def test_a_single_best_target_is_not_a_tie() -> None:
    """A decision with one best target reports tied == 1 and says nothing about a draw."""
    decision = make_router("prefix_load").route(PROMPT)
    assert decision.tied == 1 and "tied" not in decision.explain()
    assert decision.to_dict()["tied"] == 1


def test_round_robin_cycles_through_targets() -> None:
    """Round-robin ignores the cache and takes targets in turn."""
    router = make_router("round_robin")
    winners = [router.route(PROMPT).winner for _ in range(4)]
    assert winners == [("a", 0), ("b", 0), ("c", 0), ("a", 0)]


def test_random_is_reproducible_with_a_seed() -> None:
    """Two routers with the same seed make the same choices, spread over the targets."""
    one, two = make_router("random", seed=7), make_router("random", seed=7)
    first = [one.route(PROMPT).winner for _ in range(30)]
    assert first == [two.route(PROMPT).winner for _ in range(30)]
    assert set(first) == {("a", 0), ("b", 0), ("c", 0)}


def test_route_with_precomputed_hashes_equals_tokens() -> None:
    """Routing on block hashes gives the decision routing on tokens gives."""
    router = make_router("longest_prefix")
    by_hashes = router.route(block_hashes=block_hashes(PROMPT, BS))
    assert by_hashes.matched == router.route(PROMPT).matched
    with pytest.raises(ValueError, match="exactly one"):
        router.route()


def test_targets_can_be_restricted_and_empty() -> None:
    """Only the given targets compete; no target means no winner."""
    router = make_router("longest_prefix")
    assert router.route(PROMPT, targets=[("a", 0), ("c", 0)]).winner == ("a", 0)
    assert router.route(PROMPT, targets=[]).winner is None


def test_policy_can_be_chosen_per_call() -> None:
    """A per-call policy overrides the router's default without replacing it."""
    router = make_router("round_robin")
    assert router.route(PROMPT, policy="longest_prefix").winner == ("b", 0)
    assert router.policy.name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy 'best'; known: "):
        make_policy("best")


def test_decision_explains_itself() -> None:
    """explain() and to_dict() name the winner, matches and load terms of every target."""
    router = make_router("prefix_load")
    router.loads.set("a", queued_blocks=1, active_blocks=2)
    decision = router.route(PROMPT)
    text = decision.explain()
    assert text.splitlines()[0] == (
        "policy prefix_load: winner b/rank0: lowest cost 2 = prefill 2 (2 new blocks) + decode 0"
    )
    assert "a/rank0: matched 2/8 blocks, queued 1, active 2" in text
    assert "<- winner" in text.splitlines()[2]
    data = decision.to_dict()
    assert data["winner"] == {"worker_id": "b", "rank": 0}
    assert data["scores"][0]["queued_blocks"] == 1  # type: ignore[index]
    assert decision.winner_score is not None and decision.winner_score.matched_blocks == 6


def test_load_book_never_goes_negative() -> None:
    """Loads add up, never drop below zero, and are forgotten with the worker."""
    loads = LoadBook()
    loads.add("a", queued_blocks=3)
    loads.add("a", queued_blocks=-5, active_blocks=2)
    assert loads.get("a") == Load(0, 2)
    loads.remove("a")
    assert loads.snapshot() == {}


@pytest.mark.parametrize("policy", ["longest_prefix", "prefix_load"])
def test_degraded_target_loses_its_prefix_bonus(policy: str) -> None:
    """An untrusted stream's matched blocks count as zero, and the decision says why."""
    router = make_router(policy)
    assert router.route(PROMPT).winner == ("b", 0)
    router.mark_degraded("b", 0, "unrecoverable loss")
    decision = router.route(PROMPT)
    assert decision.winner == ("a", 0)
    row = {(s.worker_id, s.rank): s for s in decision.scores}[("b", 0)]
    assert (row.matched_blocks, row.degraded) == (0, "unrecoverable loss")
    assert "degraded: unrecoverable loss" in decision.explain()
    assert decision.to_dict()["scores"][1]["degraded"] == "unrecoverable loss"  # type: ignore[index]
    router.mark_healthy("b")
    assert router.route(PROMPT).winner == ("b", 0)
    assert router.degraded == {}


def test_a_callers_own_credit_counts_on_a_degraded_target() -> None:
    """``credit``: blocks the caller knows are on a target (the front door's predicted
    blocks) count whatever the stream's state; its index matches do not."""
    router = make_router("longest_prefix")
    router.mark_degraded("b", 0, "replaying")
    match = router.index.match(PROMPT)
    assert router.decide(match).winner == ("a", 0)  # b's 6 indexed blocks count 0
    decision = router.decide(match, credit={("b", 0): 3, ("c", 0): 1})
    assert decision.winner == ("b", 0)
    assert decision.matched == {("a", 0): 2, ("b", 0): 3, ("c", 0): 1}
    router.mark_healthy("b")
    assert router.decide(match, credit={("b", 0): 3}).matched[("b", 0)] == 6  # the larger


def test_degraded_target_stays_routable() -> None:
    """Degraded is not removed: with no better choice the target can still win."""
    router = make_router("round_robin")
    router.mark_degraded("a", 0, "lagging")
    winners = {router.route(PROMPT).winner for _ in range(3)}
    assert winners == {("a", 0), ("b", 0), ("c", 0)}


def test_decisions_say_in_words_what_decided() -> None:
    """Each KV-aware decision carries a reason naming the term that decided it."""
    router = make_router("longest_prefix")
    assert router.route(PROMPT).reason == "most matched blocks (6)"
    router.loads.set("a", queued_blocks=5)
    router.loads.set("b", queued_blocks=2)
    decision = router.route([9] * 32)  # nothing matched anywhere: c is the least loaded
    assert decision.winner == ("c", 0)
    assert decision.reason == "3 targets match 0 blocks: the least loaded (0 blocks)"
    cost = make_router("prefix_load").route(PROMPT)
    assert cost.reason == "lowest cost 2 = prefill 2 (2 new blocks) + decode 0"
    assert cost.to_dict()["reason"] == cost.reason and cost.reason in cost.explain()


def test_a_zero_cost_scores_zero_not_minus_zero() -> None:
    """A target with nothing to compute and no load scores 0, printed "score 0"."""
    index = PrefixIndex(BS)
    index.register_worker("a", block_size=BS)
    decision = Router(index, "prefix_load").route([])
    assert "score -0" not in decision.explain() and "score 0" in decision.explain()


def test_cost_weights_can_be_set_per_decision() -> None:
    """decide(..., prefill_weight=, load_weight=) overrides the router's weights for one
    decision: a heavy load weight sends the request away from a loaded cache holder."""
    router = make_router("prefix_load")
    router.loads.set("b", queued_blocks=5)  # b: 2 new + 5 queued = 7 > a: 6 new
    match = router.index.match(PROMPT)
    assert router.decide(match).winner == ("a", 0)
    assert router.decide(match, load_weight=0.1).winner == ("b", 0)  # load hardly counts
    heavy = router.decide(match, load_weight=3.0)
    assert heavy.winner == ("a", 0) and heavy.winner_score.terms["cost"] == 6.0  # type: ignore[union-attr]
    assert router.decide(match).winner == ("a", 0)  # the router's own weights are unchanged


def test_per_request_weights_keep_a_bounded_set_of_policies() -> None:
    """Distinct client-chosen weights do not grow the router without bound, and repeated
    weights reuse one policy, so its tie draws keep spreading."""
    from kvevents.index import _router as router_module

    router = make_router("prefix_load")
    match = router.index.match([9] * 32)
    for i in range(3 * router_module._MAX_POLICIES):
        router.decide(match, prefill_weight=1.0 + i)
    assert len(router._policies) <= router_module._MAX_POLICIES
    winners = {router.decide(match, prefill_weight=0.5).winner for _ in range(60)}
    assert len(winners) == 3


def test_bounded_prefix_follows_the_cache_while_within_the_bound() -> None:
    """With loads even, the longest prefix wins, and the decision says the bound held."""
    router = make_router("bounded_prefix")
    for worker in "abc":
        router.loads.set(worker, requests=2)
    decision = router.route(PROMPT)
    assert decision.winner == ("b", 0)
    assert decision.winner_score is not None
    assert decision.winner_score.terms["cap"] == 11  # ceil(7 / 3) + 8 (twice the mean: 5)
    assert "within the bound of 11 requests in flight" in decision.reason


def test_bounded_prefix_spills_over_when_the_best_target_is_at_the_bound() -> None:
    """A target at the bound takes no more: the next best prefix within it wins, and the
    decision names the target it passed over."""
    router = make_router("bounded_prefix")
    router.loads.set("a", requests=1)
    router.loads.set("b", requests=14)
    router.loads.set("c", requests=1)
    decision = router.route(PROMPT)
    assert decision.winner == ("a", 0)  # 2 matched blocks; b is at ceil(17 / 3) + 8 = 14
    assert "a target matching 6 blocks is at the bound" in decision.reason
    rows = {(s.worker_id, s.rank): s for s in decision.scores}
    assert rows[("b", 0)].terms["within_bound"] == 0.0


def test_bounded_prefix_default_bound_is_twice_the_mean_or_eight_more() -> None:
    """The default bound keeps affinity up to twice the mean in flight or eight more than
    the mean, whichever is more: with the few requests in flight of a small cluster (9 of 11
    on one engine) affinity holds (each spill costs a prefix prefilled again where another
    copy of it then crowds the cache); with many, a target may hold twice the mean."""
    router = make_router("bounded_prefix")
    router.loads.set("a", requests=1)
    router.loads.set("b", requests=9)
    router.loads.set("c", requests=1)
    decision = router.route(PROMPT)
    assert decision.winner == ("b", 0)
    assert decision.winner_score is not None and decision.winner_score.terms["cap"] == 12
    router.loads.set("a", requests=20)
    router.loads.set("b", requests=39)
    router.loads.set("c", requests=20)
    assert router.route(PROMPT).winner == ("b", 0)  # 80 in flight: the bound is 54 (twice)
    router.loads.set("b", requests=83)
    assert router.route(PROMPT).winner == ("a", 0)  # 124: the bound is ceil(2 * 124 / 3) = 83


def test_bounded_prefix_breaks_ties_by_requests_in_flight() -> None:
    """Equal matches: the target with fewer requests in flight wins."""
    router = make_router("bounded_prefix")
    router.loads.set("a", requests=2)
    router.loads.set("b", requests=1)
    router.loads.set("c", requests=0)
    assert router.route([9] * 8).winner == ("c", 0)


def test_bounded_prefix_slack_is_checked() -> None:
    """A negative slack would refuse every target: it is a clear error."""
    from kvevents.index._router import BoundedPrefix

    with pytest.raises(ValueError, match="slack and spare must be >= 0"):
        BoundedPrefix(slack=-0.1)
    with pytest.raises(ValueError, match="slack and spare must be >= 0"):
        BoundedPrefix(spare=-1)


def test_bounded_prefix_breaks_equal_matches_by_the_room_in_each_cache() -> None:
    """Where targets match as much, the one whose cache would overflow the least with this
    request pinned beside its requests in flight wins; cache pressure never outweighs a
    match (a conversation moved off the engine holding its history costs more than the
    blocks it saves); the decision names the room it chose by."""
    router = make_router("bounded_prefix")
    router.set_capacity("a", 0, 20)
    router.set_capacity("b", 0, 20)
    router.set_capacity("c", 0, 40)
    for worker in "abc":
        router.loads.set(worker, requests=1, pinned_blocks=18)
    decision = router.route([9] * 32)  # 8 blocks nobody holds
    assert decision.winner == ("c", 0)  # 18 + 8 fits in 40; a and b overflow by 6
    rows = {(s.worker_id, s.rank): s for s in decision.scores}
    assert rows[("a", 0)].terms["overflow_blocks"] == 6
    assert rows[("c", 0)].terms["overflow_blocks"] == 0
    assert rows[("c", 0)].terms["capacity_blocks"] == 40
    assert "the most room in its cache (0 blocks over)" in decision.reason
    router.loads.set("b", pinned_blocks=40)  # far over: b still holds the longest prefix
    assert router.route(PROMPT).winner == ("b", 0)


def test_bounded_prefix_counts_what_a_request_adds_to_the_pinned_blocks() -> None:
    """``adds`` says how many of the request's blocks no request in flight pins yet on each
    target: a prefix shared with them costs that target no room (without it, the blocks it
    did not match stand for them)."""
    router = make_router("bounded_prefix")
    for worker in "abc":
        router.set_capacity(worker, 0, 20)
        router.loads.set(worker, requests=1, pinned_blocks=16)
    match = router.index.match([9] * 32)
    assert router.decide(match).tied == 3  # 8 to pin everywhere: 4 over on each
    decision = router.decide(match, adds={("a", 0): 8, ("b", 0): 2, ("c", 0): 8})
    assert decision.winner == ("b", 0)
    assert decision.winner_score is not None
    assert decision.winner_score.terms["overflow_blocks"] == 0


def test_bounded_prefix_puts_a_new_prefix_where_the_fewest_blocks_are_pinned() -> None:
    """A prompt no target holds, loads equal in requests: it goes to the target whose requests
    in flight pin the fewest blocks (its cache has the most room), every time."""
    router = make_router("bounded_prefix")
    for worker, pinned in zip("abc", (12, 3, 7), strict=True):
        router.loads.set(worker, requests=1, pinned_blocks=pinned)
    assert {router.route([9] * 8).winner for _ in range(10)} == {("b", 0)}


def test_bounded_prefix_puts_a_new_prefix_where_the_least_was_sent_lately() -> None:
    """Caches of unknown size: a prompt no target holds goes to the target asked lately to
    keep the fewest distinct blocks (its recent footprint), before the blocks its requests in
    flight pin and before their number. A match still beats any footprint; the decision names
    the footprint it chose by."""
    router = make_router("bounded_prefix")
    for worker, recent, pinned, requests in (("a", 90, 3, 0), ("b", 30, 12, 2), ("c", 60, 5, 1)):
        router.loads.set(worker, requests=requests, pinned_blocks=pinned, recent_blocks=recent)
    decision = router.route([9] * 8)
    assert decision.winner == ("b", 0)
    assert "the smallest recent footprint (30 blocks sent there lately)" in decision.reason
    rows = {(s.worker_id, s.rank): s for s in decision.scores}
    assert rows[("a", 0)].terms["recent_blocks"] == 90
    assert router.route(PROMPT).winner == ("b", 0)  # b holds the longest prefix anyway
    router.loads.set("b", recent_blocks=500)
    assert router.route(PROMPT).winner == ("b", 0)  # a match outweighs any footprint
    assert router.route([9] * 8).winner == ("c", 0)


def test_bounded_prefix_turns_a_new_prefix_away_from_crowded_caches_only() -> None:
    """Caches of known size: a footprint counts only past the cache. An engine serving one
    app's conversations takes the next app instead of one whose footprint the app's blocks
    would push past its cache; where the request fits beside everything sent lately on every
    target, the pinned blocks decide as before (a slow engine, sent less lately, does not
    look the emptiest)."""
    router = make_router("bounded_prefix")
    for worker in "abc":
        router.set_capacity(worker, 0, 100)
    loads = (("a", 98, 3, 0), ("b", 95, 2, 2), ("c", 60, 12, 1))
    for worker, recent, pinned, requests in loads:
        router.loads.set(worker, requests=requests, pinned_blocks=pinned, recent_blocks=recent)
    decision = router.route([9] * 32)  # 8 new blocks: 6 past a's cache, 3 past b's, c fits
    assert decision.winner == ("c", 0)
    assert "the least crowded cache (0 blocks sent there lately past it)" in decision.reason
    rows = {(s.worker_id, s.rank): s for s in decision.scores}
    crowding = [rows[(w, 0)].terms["crowding_blocks"] for w in "abc"]
    assert crowding == [6, 3, 0]
    router.loads.set("b", recent_blocks=70)  # b and c both have room: fewer pinned wins
    assert router.route([9] * 32).winner == ("b", 0)
    for worker in "abc":
        router.set_capacity(worker, 0, 1000)  # room everywhere
    assert router.route([9] * 32).winner == ("b", 0)
    router.loads.set("a", pinned_blocks=1)
    assert router.route([9] * 32).winner == ("a", 0)


def test_bounded_prefix_sends_a_prefix_back_where_it_was_sent_lately() -> None:
    """Where targets match as much (nobody holds the prefix now), the one the request's
    leading blocks were sent to lately wins, even with a larger footprint: an app's next
    conversation goes back to the engine that served the app, which evicted its system prompt
    for a moment, instead of adding the app to another engine's cache."""
    router = make_router("bounded_prefix")
    for worker, recent in (("a", 90), ("b", 30), ("c", 60)):
        router.loads.set(worker, requests=1, recent_blocks=recent)
    match = router.index.match([9] * 32)
    decision = router.decide(match, recent_matched={("a", 0): 6, ("b", 0): 0, ("c", 0): 2})
    assert decision.winner == ("a", 0)
    assert "the most of its prefix sent there lately (6 blocks)" in decision.reason
    assert decision.winner_score is not None
    assert decision.winner_score.terms["recent_matched_blocks"] == 6


def test_bounded_prefix_shows_no_footprint_where_none_is_known() -> None:
    """Without footprints (kvevents serve's /query: no front door sends the requests) the
    terms do not list them and the pinned blocks break the tie as before."""
    router = make_router("bounded_prefix")
    for worker, pinned in zip("abc", (12, 3, 7), strict=True):
        router.loads.set(worker, requests=1, pinned_blocks=pinned)
    decision = router.route([9] * 8)
    assert decision.winner == ("b", 0)
    assert all("recent_blocks" not in s.terms for s in decision.scores)
    assert "the fewest blocks pinned by requests in flight (3)" in decision.reason


def test_capacity_is_set_per_target_and_checked() -> None:
    """set_capacity keeps a target's cache size (None forgets it); a size under one block is
    a clear error; without any, bounded_prefix shows no cache terms."""
    router = make_router("bounded_prefix")
    router.set_capacity("a", 0, 64)
    assert router.capacity == {("a", 0): 64}
    router.set_capacity("a", 0, None)
    assert router.capacity == {}
    with pytest.raises(ValueError, match="at least one block"):
        router.set_capacity("a", 0, 0)
    decision = router.route(PROMPT)
    assert all("overflow_blocks" not in s.terms for s in decision.scores)


def test_load_book_keeps_pinned_blocks_apart_from_added_terms() -> None:
    """pinned_blocks is set, never added to: add() of other terms keeps it."""
    book = LoadBook()
    book.set("a", pinned_blocks=5)
    book.add("a", queued_blocks=3, requests=1)
    assert book.get("a") == Load(3, 0, 1, 5)
    book.set("a", recent_blocks=40)
    book.add("a", queued_blocks=-3, requests=-1)
    assert book.get("a") == Load(0, 0, 0, 5, 40)
