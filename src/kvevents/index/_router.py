"""Routing policies over the prefix index, each decision explainable. Pure and in-process.

A *target* is one (worker, rank): attention-DP ranks are routed to separately. A policy gets
the index's :class:`~kvevents.index.MatchResult` for a request, the targets and their
:class:`Load`, and returns a :class:`Decision` that names the winner and, for every target,
the matched blocks, the load terms and the score that decided.

Policies:

- ``longest_prefix``: most matched blocks wins; ties go to the lower load, then to a seeded
  random choice among the tied targets.
- ``prefix_load``: a cost model in blocks, lowest wins (the shape Dynamo's KV router uses):
  ``cost = prefill_weight * (request_blocks - matched_blocks + queued_blocks) + active_blocks``
  — the prefill work this request would add on top of the prefill already queued there,
  plus the decode load (KV blocks held by running requests). Ties go to the target with more
  matched blocks, then to a seeded random choice (never to the first target: that makes the
  lowest-numbered engine a hot spot whenever the cluster is idle).
- ``bounded_prefix``: longest prefix among the targets whose requests in flight stay within
  a bound: ``(1 + slack)`` times the mean over the targets (this request counted; slack 1.0
  by default: twice the mean) or ``spare`` more than the mean (8 by default), whichever is
  more. Affinity decides until one target takes a share of the load that only a hot prefix
  gives it; then the prefix spills over to the next target instead of piling onto one
  (consistent hashing with bounded loads, with the cache's prefix as the affinity). Among
  targets that match as much (a prefix nobody holds, typically), the one with the most room
  in its cache wins: the fewest blocks its requests in flight would pin beyond its capacity
  with this one beside them (where the capacity is known, :meth:`Router.set_capacity`);
  then the one the request's leading blocks were sent to lately, cached there now or not
  (:attr:`RouteInputs.recent_matched`: an app's next conversation goes back to the engine
  that serves the app and evicted its system prompt a moment ago, instead of adding the app
  to another engine's cache); then the least crowded cache: the fewest blocks by which
  everything sent to it lately, this request beside it, goes past its capacity
  (:attr:`Load.recent_blocks`, the front door's :class:`~._recent.RecentBlocks`; the
  footprint itself where the capacity is unknown), so that apps spread over the engines by
  what they take up; then the fewest pinned blocks; then fewer requests in flight, then fewer
  load blocks, then a seeded random choice. The bound is loose on purpose. On three vLLM engines each caching a
  third of a chat workload (docs/route.md), every spill cost a system prompt's prefill on an
  engine that then held two copies of it, and that pressure evicted other prompts and
  histories: a bound of twice the mean alone served 0.79 of prompt tokens from cache (three
  runs), with 1.25 times the mean 0.76, and with the bound out of reach at that load 0.85,
  requests spread more evenly too (max/mean 1.09 against 1.21). Cache pressure breaks ties
  and never outweighs a match: spilling a conversation whose history an engine holds because
  its cache looked full cost more than the blocks it saved (0.81 against 0.85). It needs a
  load book that counts requests in flight (the front door keeps one).
- ``round_robin`` and ``random`` (seeded): baselines that ignore the cache.

Degraded targets. A target whose event stream is not trustworthy (the subscriber reported an
unrecoverable loss, so the index may still list blocks the engine evicted) is marked with
:meth:`Router.mark_degraded`. It stays routable, but its matched blocks count as zero: a
phantom prefix hit must not attract traffic. Every decision names degraded targets and why.

Loads are not measured here: the caller (a simulation, or a service fed by engines' load
reports) keeps them in a :class:`LoadBook`.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvevents.events import StreamKey
from kvevents.index._decision import (
    Decision,
    Load,
    LoadBook,
    RouteInputs,
    TargetScore,
    _row,
)
from kvevents.index._keys import MMSpan
from kvevents.index._prefix import MatchResult, PrefixIndex

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "BoundedPrefix",
    "LongestPrefix",
    "Policy",
    "PrefixLoad",
    "RandomChoice",
    "RoundRobin",
    "Router",
    "make_policy",
]

#: The policy a :class:`Router` (and ``kvevents serve``) uses unless told otherwise. Chosen by
#: measurement (docs/evaluation.md): on the Mooncake synthetic trace it has the highest reuse
#: of every policy on 4, 8 and 16 engines with small and large caches (100.8% of the
#: pooled-cache reference on 8 engines), max/mean requests per engine 1.04-1.15, and the
#: TTFT of the best alternative.
DEFAULT_POLICY = "longest_prefix"


class Policy(Protocol):
    """A routing policy: a name and a choice over targets."""

    name: str

    def choose(self, inputs: RouteInputs) -> Decision: ...


def _decision(
    name: str,
    inputs: RouteInputs,
    scores: Sequence[float],
    terms: Sequence[Mapping[str, float]],
    winner: int | None,
    tied: int = 1,
    reason: str = "",
) -> Decision:
    degraded = inputs.degraded or [None] * len(inputs.targets)
    rows = tuple(
        TargetScore(t[0], t[1], m, r, s, ld, tm, d)
        for t, m, r, s, ld, tm, d in zip(
            inputs.targets,
            inputs.matched,
            inputs.request_blocks,
            scores,
            inputs.loads,
            terms,
            degraded,
            strict=True,
        )
    )
    chosen = None if winner is None else inputs.targets[winner]
    return Decision(chosen, name, rows, inputs.request_tokens, tied if chosen else 0, reason)


def _best(keys: Sequence[tuple[float, ...]], rng: _random.Random) -> tuple[int | None, int]:
    """Index of the largest key, and how many targets share it. Ties are broken by ``rng``,
    uniformly: taking the first would send every tie to the lowest-numbered target (a hot
    spot: with idle engines and no cached prefix, every target ties)."""
    if not keys:
        return None, 0
    top = max(keys)
    tied = [i for i, key in enumerate(keys) if key == top]
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), len(tied)


@dataclass
class LongestPrefix:
    """Most matched blocks wins; ties: lower total load, then a seeded random choice."""

    seed: int = 0
    name: str = "longest_prefix"
    _rng: _random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = _random.Random(self.seed)

    def choose(self, inputs: RouteInputs) -> Decision:
        scores = [float(m) for m in inputs.matched]
        keys = [
            (s, -float(ld.queued_blocks + ld.active_blocks))
            for s, ld in zip(scores, inputs.loads, strict=True)
        ]
        terms = [
            {"matched_blocks": s, "load_blocks": -k[1]} for s, k in zip(scores, keys, strict=True)
        ]
        winner, tied = _best(keys, self._rng)
        reason = _prefix_reason(keys, winner, tied)
        return _decision(self.name, inputs, scores, terms, winner, tied, reason)


def _prefix_reason(keys: Sequence[tuple[float, float]], winner: int | None, tied: int) -> str:
    """What decided a longest-prefix choice, in words."""
    if winner is None:
        return "no target"
    matched, load = keys[winner][0], -keys[winner][1]
    same_match = sum(1 for k in keys if k[0] == matched)
    if tied > 1:
        return (
            f"{tied} targets tie on {matched:g} matched blocks and load {load:g}: drawn at random"
        )
    if same_match > 1:
        return f"{same_match} targets match {matched:g} blocks: the least loaded ({load:g} blocks)"
    return f"most matched blocks ({matched:g})"


@dataclass
class PrefixLoad:
    """Lowest ``prefill_weight * (new + queued) + active`` blocks wins; ties: more matched,
    then a seeded random choice."""

    prefill_weight: float = 1.0
    seed: int = 0
    load_weight: float = 1.0
    name: str = "prefix_load"
    _rng: _random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = _random.Random(self.seed)

    def choose(self, inputs: RouteInputs) -> Decision:
        # One pass building the rows directly: this runs for every routed request, once per
        # target, and is most of a decision's cost.
        weight, load_weight = self.prefill_weight, self.load_weight
        targets = inputs.targets
        degraded = inputs.degraded or [None] * len(targets)
        rows: list[TargetScore] = []
        winner: int | None = None
        best = (0.0, 0.0)
        tied = 0
        for i, (target, m, r, load, why) in enumerate(
            zip(targets, inputs.matched, inputs.request_blocks, inputs.loads, degraded, strict=True)
        ):
            queued, active = load.queued_blocks, load.active_blocks
            new = r - m if r > m else 0
            prefill = weight * (new + load_weight * queued)
            decode = load_weight * active
            cost = prefill + decode
            terms = {
                "new_blocks": new,
                "prefill_cost": prefill,
                "decode_cost": decode,
                "cost": cost,
            }
            # 0.0 - cost, not -cost: a zero cost must not print as "score -0".
            rows.append(_row((target[0], target[1], m, r, 0.0 - cost, load, terms, why)))
            key = (-cost, m)
            if winner is None or key > best:
                winner, best, tied = i, key, 1
            elif key == best:
                # Reservoir sampling: each of the tied targets ends up chosen with
                # probability 1/tied, in one pass.
                tied += 1
                if self._rng.randrange(tied) == 0:
                    winner = i
        chosen = None if winner is None else targets[winner]
        reason = "no target" if winner is None else _cost_reason(rows[winner].terms, tied)
        return Decision(chosen, self.name, tuple(rows), inputs.request_tokens, tied, reason)


def _cost_reason(terms: Mapping[str, float], tied: int) -> str:
    why = (
        f"lowest cost {terms['cost']:g} = prefill {terms['prefill_cost']:g} "
        f"({terms['new_blocks']:g} new blocks) + decode {terms['decode_cost']:g}"
    )
    return f"{why}; {tied} targets tie: drawn at random" if tied > 1 else why


@dataclass
class BoundedPrefix:
    """Longest prefix among the targets within the load bound (module docstring); ties: the
    most room in the cache, fewer requests in flight, fewer load blocks, then a seeded random
    choice."""

    slack: float = 1.0
    seed: int = 0
    name: str = "bounded_prefix"
    spare: int = 8
    _rng: _random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.slack < 0 or self.spare < 0:
            raise ValueError(f"slack and spare must be >= 0, got {self.slack} and {self.spare}")
        self._rng = _random.Random(self.seed)

    def cap(self, loads: Sequence[Load]) -> int:
        """The most requests in flight a target may have with this request on it."""
        mean = (sum(load.requests for load in loads) + 1) / max(1, len(loads))
        return max(1, math.ceil((1.0 + self.slack) * mean - 1e-9), math.ceil(mean) + self.spare)

    def choose(self, inputs: RouteInputs) -> Decision:
        loads = inputs.loads
        cap = self.cap(loads)
        count = len(loads)
        capacity = inputs.capacity or [None] * count
        adds = inputs.adds or [
            max(0, r - m) for r, m in zip(inputs.request_blocks, inputs.matched, strict=True)
        ]
        sent = inputs.recent_matched or [0] * count
        keys: list[tuple[float, ...]] = []
        terms: list[dict[str, float]] = []
        footprints = any(ld.recent_blocks for ld in loads)
        for m, r, ld, size, add, lately in zip(
            inputs.matched, inputs.request_blocks, loads, capacity, adds, sent, strict=True
        ):
            ok = ld.requests + 1 <= cap
            over = _overflow(ld.pinned_blocks, add, size)
            crowded = _crowding(ld.recent_blocks, max(0, r - lately), size)
            pinned = float(ld.pinned_blocks)
            load = (-float(ld.requests), -_blocks(ld))
            # Over the bound: only less loaded ones beat it (when every target is over).
            ties = (float(m), -float(over), float(lately), -float(crowded), -pinned)
            keys.append((float(ok), *(ties if ok else (0.0,) * len(ties)), *load))
            row = {"matched_blocks": float(m), "requests": float(ld.requests), "cap": float(cap)}
            if size is not None:
                row.update(pinned_blocks=pinned, capacity_blocks=float(size))
                row["overflow_blocks"] = float(over)
            if footprints:
                row.update(recent_matched_blocks=float(lately), recent_blocks=ld.recent_blocks)
                row["crowding_blocks"] = float(crowded)
            row["within_bound"] = float(ok)
            terms.append(row)
        scores = [k[1] if k[0] else -1.0 for k in keys]
        winner, tied = _best(keys, self._rng)
        reason = _bounded_reason(inputs, keys, winner, tied, cap)
        return _decision(self.name, inputs, scores, terms, winner, tied, reason)


def _overflow(pinned: int, adds: int, capacity: int | None) -> int:
    """Blocks a target's cache must give up for a request that pins ``adds`` more blocks on
    top of the ``pinned`` ones of its requests in flight (0 when its capacity is unknown)."""
    return 0 if capacity is None else max(0, pinned + adds - capacity)


def _crowding(recent: int, adds: int, capacity: int | None) -> int:
    """How far a target's recent footprint with ``adds`` more blocks would go past its cache
    (the footprint itself when the capacity is unknown): 0 where the request fits beside
    everything sent there lately, so that only a crowded cache turns a prefix away and an
    engine with room everywhere is chosen by its load instead (a slow engine, whose requests
    come back later, is sent less: under a raw footprint it would look the emptiest)."""
    return recent if capacity is None else _overflow(recent, adds, capacity)


def _blocks(load: Load) -> float:
    return float(load.queued_blocks + load.active_blocks)


def _bounded_reason(
    inputs: RouteInputs,
    keys: Sequence[tuple[float, ...]],
    winner: int | None,
    tied: int,
    cap: int,
) -> str:
    """What decided a bounded-prefix choice, in words."""
    if winner is None:
        return "no target"
    key = keys[winner]
    matched = key[1]
    why = f"most matched blocks ({matched:g}) within the bound of {cap} requests in flight"
    best_anywhere = max(inputs.matched, default=0)
    if best_anywhere > matched:
        why += f"; a target matching {best_anywhere} blocks is at the bound"
    # The tie-break that set the winner apart from the targets matching as much, if one did.
    rivals = [k for k in keys if k[:2] == key[:2] and k != key]
    if rivals and key[2] > max(k[2] for k in rivals):
        why += f"; the most room in its cache ({-key[2]:g} blocks over)"
    elif rivals and key[2:4] > max(k[2:4] for k in rivals):
        why += f"; the most of its prefix sent there lately ({key[3]:g} blocks)"
    elif rivals and key[2:5] > max(k[2:5] for k in rivals):
        if inputs.capacity and inputs.capacity[winner] is not None:
            why += f"; the least crowded cache ({-key[4]:g} blocks sent there lately past it)"
        else:
            why += f"; the smallest recent footprint ({-key[4]:g} blocks sent there lately)"
    elif rivals and key[2:6] > max(k[2:6] for k in rivals):
        why += f"; the fewest blocks pinned by requests in flight ({-key[5]:g})"
    if tied > 1:
        why += f"; {tied} targets tie: drawn at random"
    return why


@dataclass
class RoundRobin:
    """Targets in turn, ignoring the cache (a baseline)."""

    name: str = "round_robin"
    _next: int = field(default=0, repr=False)

    def choose(self, inputs: RouteInputs) -> Decision:
        count = len(inputs.targets)
        winner = None if not count else self._next % count
        self._next += 1
        scores = [1.0 if i == winner else 0.0 for i in range(count)]
        return _decision(self.name, inputs, scores, [{}] * count, winner)


@dataclass
class RandomChoice:
    """A uniformly random target from a seeded generator (a baseline)."""

    seed: int = 0
    name: str = "random"
    _rng: _random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = _random.Random(self.seed)

    def choose(self, inputs: RouteInputs) -> Decision:
        count = len(inputs.targets)
        winner = self._rng.randrange(count) if count else None
        scores = [1.0 if i == winner else 0.0 for i in range(count)]
        return _decision(self.name, inputs, scores, [{}] * count, winner)


#: Policy names accepted by :func:`make_policy` and ``POST /query``.
POLICIES: dict[str, Callable[..., Policy]] = {
    "longest_prefix": lambda seed=0, **_: LongestPrefix(seed),
    "prefix_load": lambda prefill_weight=1.0, seed=0, load_weight=1.0, **_: PrefixLoad(
        prefill_weight, seed, load_weight
    ),
    "bounded_prefix": lambda seed=0, slack=1.0, **_: BoundedPrefix(slack, seed),
    "round_robin": lambda **_: RoundRobin(),
    "random": lambda seed=0, **_: RandomChoice(seed),
}


def make_policy(
    name: str, *, seed: int = 0, prefill_weight: float = 1.0, load_weight: float = 1.0
) -> Policy:
    """A policy by name; ``ValueError`` naming the known ones otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory(seed=seed, prefill_weight=prefill_weight, load_weight=load_weight)


# Policies with per-request cost weights a router keeps at most (the oldest such is dropped).
_MAX_POLICIES = 64


class Router:
    """Routes requests over a :class:`PrefixIndex` with a policy and a :class:`LoadBook`.

    Pure and in-process: ``route`` reads the index and the loads and changes nothing but the
    state of stateful baselines (round-robin position, random generator). A simulation
    updates ``loads`` itself as requests start and finish.
    """

    def __init__(
        self,
        index: PrefixIndex,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        loads: LoadBook | None = None,
        seed: int = 0,
        prefill_weight: float = 1.0,
        load_weight: float = 1.0,
    ) -> None:
        self.index = index
        self.loads = loads if loads is not None else LoadBook()
        self._seed = seed
        self._prefill_weight = prefill_weight
        self._load_weight = load_weight
        self._policies: dict[str | tuple[str, float, float], Policy] = {}
        self.policy = self._policy(policy)
        self.degraded: dict[StreamKey, str] = {}
        #: Per target, the blocks its cache holds at most, where known (:meth:`set_capacity`).
        self.capacity: dict[StreamKey, int] = {}

    def mark_degraded(self, worker_id: str, rank: int, reason: str) -> None:
        """Stop trusting this target's matched blocks (it stays routable) until healthy."""
        self.degraded[(worker_id, rank)] = reason

    def mark_healthy(self, worker_id: str, rank: int | None = None) -> None:
        """Trust the target again (every rank of the worker when ``rank`` is None)."""
        for target in [t for t in self.degraded if t[0] == worker_id]:
            if rank is None or target[1] == rank:
                del self.degraded[target]

    def set_capacity(self, worker_id: str, rank: int, blocks: int | None) -> None:
        """The blocks the target's cache holds at most (None: not known), for the policies
        that keep requests within it (``bounded_prefix``)."""
        if blocks is None:
            self.capacity.pop((worker_id, rank), None)
        elif blocks < 1:
            raise ValueError(f"capacity must be at least one block, got {blocks}")
        else:
            self.capacity[(worker_id, rank)] = blocks

    def _policy(
        self,
        policy: str | Policy | None,
        prefill_weight: float | None = None,
        load_weight: float | None = None,
    ) -> Policy:
        if policy is None and prefill_weight is None and load_weight is None:
            return self.policy
        if policy is not None and not isinstance(policy, str):
            self._policies[policy.name] = policy
            return policy
        name = policy if policy is not None else self.policy.name
        weights = (
            self._prefill_weight if prefill_weight is None else prefill_weight,
            self._load_weight if load_weight is None else load_weight,
        )
        key = name if weights == (self._prefill_weight, self._load_weight) else (name, *weights)
        found = self._policies.get(key)
        if found is None:
            # Kept, not rebuilt per request: a fresh seeded policy would draw the same tied
            # target every time. Bounded: weights come from clients.
            if len(self._policies) >= _MAX_POLICIES:
                oldest = next((k for k in self._policies if isinstance(k, tuple)), None)
                if oldest is not None:
                    self._policies.pop(oldest)
            found = self._policies[key] = make_policy(
                name, seed=self._seed, prefill_weight=weights[0], load_weight=weights[1]
            )
        return found

    def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[int] | None = None,
        block_size: int | None = None,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMSpan] = (),
        targets: Sequence[StreamKey] | None = None,
        policy: str | Policy | None = None,
    ) -> Decision:
        """Match the request (tokens, or precomputed block hashes) and decide; ``cache_salt``
        and ``mm`` as in :meth:`PrefixIndex.match`."""
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("route() takes exactly one of token_ids and block_hashes")
        if token_ids is not None:
            match = self.index.match(token_ids, lora=lora, cache_salt=cache_salt, mm=mm)
        else:
            assert block_hashes is not None
            match = self.index.match_hashes(block_hashes, block_size=block_size)
        return self.decide(match, targets=targets, policy=policy)

    def decide(
        self,
        match: MatchResult,
        *,
        targets: Sequence[StreamKey] | None = None,
        policy: str | Policy | None = None,
        prefill_weight: float | None = None,
        load_weight: float | None = None,
        adds: Mapping[StreamKey, int] | None = None,
        recent_matched: Mapping[StreamKey, int] | None = None,
        credit: Mapping[StreamKey, int] | None = None,
    ) -> Decision:
        """Decide from a match already made (e.g. to compare policies on one request);
        ``prefill_weight`` and ``load_weight`` override the router's cost weights for it;
        ``adds``: per target, the blocks the request would pin there beyond those its
        requests in flight pin (:attr:`RouteInputs.adds`; unknown by default);
        ``recent_matched``: per target, the request's leading blocks sent there lately
        (:attr:`RouteInputs.recent_matched`; unknown by default); ``credit``: per target,
        leading blocks the caller knows are there whatever the index says (the front door's
        predicted blocks, of requests it sent there itself): they count on a degraded target
        too, whose index matches do not."""
        chosen = self._policy(policy, prefill_weight, load_weight)
        targets = self.index.targets() if targets is None else list(targets)
        sizes = self.index.stream_block_size
        request = match.request_blocks
        streams = match.streams
        matched = [streams.get(t, 0) for t in targets]
        degraded: list[str | None] = []
        if self.degraded:
            degraded = [self.degraded.get(t) for t in targets]
            matched = [0 if why else m for m, why in zip(matched, degraded, strict=True)]
        if credit:
            matched = [max(m, credit.get(t, 0)) for m, t in zip(matched, targets, strict=True)]
        inputs = RouteInputs(
            targets=targets,
            matched=matched,
            request_blocks=[request.get(sizes(*t) or 0, 0) for t in targets],
            loads=self.loads.many(targets),
            request_tokens=match.request_tokens,
            degraded=degraded,
            capacity=[self.capacity.get(t) for t in targets] if self.capacity else (),
            adds=[adds.get(t, 0) for t in targets] if adds is not None else (),
            recent_matched=[recent_matched.get(t, 0) for t in targets]
            if recent_matched is not None
            else (),
        )
        return chosen.choose(inputs)
