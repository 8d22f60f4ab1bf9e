"""Closed-loop multi-turn chat over a simulated cluster, as a benchmark client drives real engines.

:func:`run_policy` (``kvevents simulate``) replays a trace open-loop: every row arrives at its
timestamp whatever the cluster does. A chat benchmark client is closed-loop instead: it keeps
``concurrency`` conversations going, and sends a conversation's next turn the moment the
previous answer ends (no think time); a finished conversation makes room for the next one.
:func:`run_conversations` does that in virtual time, with the same :class:`PolicyRun`, so its
figures can be set next to a real run of the same prompts (``bench/bench_route.py``).

Each conversation is the list of its turns' *full* prompts (token ids as the engine saw them:
history, the engine's own earlier answers, template tokens) with their answer lengths, so the
simulated engines see the real prefixes; their answers are the simulator's own tokens, which no
later prompt contains (as a real answer, detokenized and re-tokenized, often is not either).

``load_view`` says what load the router is given: ``"engine"`` is what
:class:`PolicyRun` gives it today, every engine's true queued and active blocks and requests
at the instant of the decision (no real router has that); ``"inflight"`` is what a front door
(``kvevents route``) knows by itself: the requests it sent and that have not finished, per
target, their count, their prompt blocks not matched at the decision (as queued prefill)
until their first token comes out, then their prompt blocks (as held) until they end, as the
front door moves them when an answer's first byte comes back. With it, as the front door does, the
prompt blocks of a request in flight are credited to its target at once (predicted blocks):
the requests right behind it find them there before the engine has stored anything.

``first_token_delay`` says when the router and the client see an answer. At 0 they see each
token as the engine's step that made it ends. An engine's server on a loaded machine hands
tokens out late and in bursts. On the route rig's vLLM engines, the first token reached the
client 0.2-0.9 s after the engine made it, on average, and a third of the answers arrived
in one piece. With a delay, each request's first token is seen a random time after its engine made it
(exponentially distributed with that mean, seeded), and the answer's end no earlier: an answer
that ended meanwhile is seen whole at once. Until then the in-flight view counts the request
as prefilling and the client waits. ``prefix_load`` is the policy this moves most
(``longest_prefix`` only through its ties, which go to the lower load). Its decode term is
the prompt blocks of the requests seen answering, and a router that sees fewer of them keeps
more requests on the engine holding their prefix (docs/simulate.md).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kvevents.events import StreamKey
from kvevents.index import DEFAULT_RECENT_WINDOW, MatchResult, RecentBlocks
from kvevents.sim._cluster import Cluster
from kvevents.sim._engine import SimulatedEngine
from kvevents.sim._records import Request, RequestRecord
from kvevents.sim._simulate import PolicyReport, PolicyRun, SimulationConfig

__all__ = ["ConversationsRun", "LoadView", "run_conversations"]

LoadView = Literal["engine", "inflight"]


@dataclass(frozen=True)
class ConversationsRun:
    """The policy's report, every finished request (the engines' virtual times) in order of
    ending, and per request the virtual times the router and the client saw its first token
    and its end (the engine's own times where ``first_token_delay`` is 0)."""

    report: PolicyReport
    finished: tuple[RequestRecord, ...]
    seen: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _InFlight:
    target: StreamKey
    new_blocks: int  # prompt blocks to prefill (prompt minus matched at the decision)
    held_blocks: int  # blocks the request holds while it runs
    token_ids: Sequence[int] = ()  # its prompt (its full blocks are predicted on target)
    hashes: Sequence[int] = ()  # its prompt's full blocks (pinned on target while it runs)
    answering: bool = False  # its first token came out: its prefill is done


def _common_blocks(a: Sequence[int], b: Sequence[int], size: int) -> int:
    """Full blocks of ``size`` tokens that ``a`` and ``b`` share from their start."""
    blocks = min(len(a), len(b)) // size
    for i in range(blocks):
        if a[i * size : (i + 1) * size] != b[i * size : (i + 1) * size]:
            return i
    return blocks


class _ClosedLoopRun(PolicyRun):
    """A :class:`PolicyRun` whose router can be given its own in-flight view of load."""

    def __init__(
        self,
        cluster: Cluster,
        policy: str,
        config: SimulationConfig,
        load_view: LoadView,
        recent_window: float = DEFAULT_RECENT_WINDOW,
    ) -> None:
        super().__init__(cluster, policy, config)
        self.load_view = load_view
        self.in_flight: dict[str, _InFlight] = {}
        self._at = 0.0  # the virtual time of the request being routed
        self.recent = RecentBlocks(recent_window, clock=lambda: self._at)

    def submit(self, request: Request, arrival: float) -> StreamKey | None:
        self._at = arrival
        return super().submit(request, arrival)

    def _update_loads(self) -> None:
        if self.load_view == "engine":
            super()._update_loads()
            return
        queued: dict[StreamKey, int] = dict.fromkeys(self._targets, 0)
        active: dict[StreamKey, int] = dict.fromkeys(self._targets, 0)
        requests: dict[StreamKey, int] = dict.fromkeys(self._targets, 0)
        for request in self.in_flight.values():
            if request.answering:
                active[request.target] += request.held_blocks
            else:
                queued[request.target] += request.new_blocks
            requests[request.target] += 1
        pins = self._pins()
        self.recent.expire()
        for target in self._targets:
            self.router.loads.set(
                target[0],
                target[1],
                queued_blocks=queued[target],
                active_blocks=active[target],
                requests=requests[target],
                pinned_blocks=len(pins[target]),
                recent_blocks=self.recent.size(target),
            )

    def _pins(self) -> dict[StreamKey, set[int]]:
        """Per target, the distinct blocks its requests in flight pin."""
        pins: dict[StreamKey, set[int]] = {t: set() for t in self._targets}
        for request in self.in_flight.values():
            pins[request.target].update(request.hashes)
        return pins

    def route(self, request: Request) -> StreamKey | None:
        if self.load_view == "engine" or not self._uses_load:
            return super().route(request)
        self._update_loads()
        match = self.router.index.match(request.token_ids)
        hashes = self._hashes(request)
        pins = self._pins()
        adds = {t: sum(1 for h in hashes if h not in pins[t]) for t in self._targets}
        lately = {t: self.recent.prefix(t, hashes) for t in self._targets}
        self.last_decision = self.router.decide(
            self._with_predicted(match, request.token_ids),
            targets=self._targets,
            adds=adds,
            recent_matched=lately,
        )
        return self.last_decision.winner

    def _hashes(self, request: Request) -> list[int]:
        engine = next(iter(self.cluster.engines.values()))
        return engine.block_hashes(request.token_ids, request.lora_name)

    def _with_predicted(self, match: MatchResult, token_ids: Sequence[int]) -> MatchResult:
        """``match`` with each target raised to the blocks its requests in flight predict."""
        size = self.cluster.config.block_size
        streams = dict(match.streams)
        for flight in self.in_flight.values():
            shared = _common_blocks(token_ids, flight.token_ids, size)
            if shared > streams.get(flight.target, 0):
                streams[flight.target] = shared
        return replace(match, streams=streams)

    def sent(self, request: Request, target: StreamKey) -> None:
        """Book ``request`` as in flight on ``target`` (the decision's matched blocks known)."""
        size = self.cluster.config.block_size
        blocks = math.ceil(len(request.token_ids) / size)
        decision = self.last_decision
        matched = decision.matched.get(target, 0) if decision is not None else 0
        hashes = self._hashes(request)
        self.in_flight[request.request_id] = _InFlight(
            target, max(0, blocks - matched), blocks, request.token_ids, hashes
        )
        self.recent.touch(target, hashes)


@dataclass
class _Client:
    """The closed-loop client: ``concurrency`` conversations in flight, each turn after the last."""

    conversations: Sequence[Sequence[Request]]
    concurrency: int

    def __post_init__(self) -> None:
        self._next_conversation = 0
        self._ready: list[tuple[float, int, int, int]] = []  # (time, order, conversation, turn)
        self._order = 0
        for _ in range(min(self.concurrency, len(self.conversations))):
            self._start_next(0.0)

    def _start_next(self, at: float) -> None:
        while self._next_conversation < len(self.conversations):
            conversation = self._next_conversation
            self._next_conversation += 1
            if self.conversations[conversation]:
                self._push(at, conversation, 0)
                return

    def _push(self, at: float, conversation: int, turn: int) -> None:
        heapq.heappush(self._ready, (at, self._order, conversation, turn))
        self._order += 1

    def next_time(self) -> float:
        return self._ready[0][0] if self._ready else math.inf

    def pop(self) -> tuple[float, int, int]:
        at, _, conversation, turn = heapq.heappop(self._ready)
        return at, conversation, turn

    def answered(self, at: float, conversation: int, turn: int) -> None:
        """A turn ended at ``at``: the conversation's next turn, or the next conversation."""
        if turn + 1 < len(self.conversations[conversation]):
            self._push(at, conversation, turn + 1)
        else:
            self._start_next(at)


def run_conversations(
    conversations: Sequence[Sequence[Request]],
    policy: str,
    config: SimulationConfig | None = None,
    *,
    concurrency: int,
    load_view: LoadView = "engine",
    speeds: Sequence[float] = (),
    recent_window: float = DEFAULT_RECENT_WINDOW,
    first_token_delay: float = 0.0,
    seed: int = 0,
) -> ConversationsRun:
    """Every turn of ``conversations`` through a fresh cluster, closed-loop at ``concurrency``.

    Request ids must be unique; a conversation's turns are sent in order, each once the
    previous one has been seen to end. Engines advance in virtual time, the least advanced
    busy one first, so every answer is seen at the moment it is due. ``speeds``: each engine's
    step time as a multiple of the configured one, in worker order (engines sharing a machine
    do not run equally fast; a slower one keeps its requests in flight longer, which a policy
    bounding requests in flight answers by sending elsewhere); none: all equal.
    ``recent_window``: the seconds a block sent to a target counts in its footprint (the
    in-flight view's ``recent_blocks``, as the front door's ``--recent-window``).
    ``first_token_delay``: the mean seconds between an engine making a request's first token
    and the router and the client seeing it (module docstring); ``seed`` draws the delays.
    """
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    if load_view not in ("engine", "inflight"):
        raise ValueError(f"load_view must be 'engine' or 'inflight', got {load_view!r}")
    if not (first_token_delay >= 0 and math.isfinite(first_token_delay)):
        raise ValueError(f"first_token_delay must be a finite number >= 0, got {first_token_delay}")
    config = config or SimulationConfig()
    if speeds and (len(speeds) != config.cluster.workers or min(speeds) <= 0):
        raise ValueError(f"speeds must be one positive factor per worker, got {list(speeds)}")
    began = time.monotonic()
    where = {
        request.request_id: (c, t)
        for c, turns in enumerate(conversations)
        for t, request in enumerate(turns)
    }
    with Cluster(config.cluster) as cluster:
        for engine, factor in zip(cluster.engines.values(), speeds, strict=False):
            engine.config = replace(
                engine.config,
                step_base_s=engine.config.step_base_s * factor,
                step_token_s=engine.config.step_token_s * factor,
            )
        run = _ClosedLoopRun(cluster, policy, config, load_view, recent_window)
        client = _Client(conversations, concurrency)
        delivery = _Delivery(run, client, where, first_token_delay, seed)
        counted = (dict.fromkeys(cluster.engines, 0), dict.fromkeys(cluster.engines, 0))
        while True:
            busy = [(e.now, w) for w, e in cluster.engines.items() if e.has_work()]
            step_at = min(busy)[0] if busy else math.inf
            due_at, client_at = delivery.next_time(), client.next_time()
            if step_at < min(client_at, due_at):
                worker = min(busy)[1]
                run._step(worker, cluster.engines[worker])
                _collect(cluster.engines[worker], worker, counted, delivery)
            elif due_at <= client_at and due_at < math.inf:
                delivery.due()
            elif client_at < math.inf:
                at, c, t = client.pop()
                request = conversations[c][t]
                target = run.submit(request, at)
                if target is None:  # rejected: the conversation goes on without it
                    client.answered(at, c, t)
                else:
                    run.sent(request, target)
            else:
                break
        report = run.finish(time.monotonic() - began)
        finished = [r for engine in cluster.engines.values() for r in engine.finished_requests]
        return ConversationsRun(
            report, tuple(sorted(finished, key=lambda r: r.finished_at)), dict(delivery.seen)
        )


class _Delivery:
    """When the router and the client see each answer's first token and its end: as the
    engine's step ends, or ``delay`` seconds later on average (module docstring)."""

    def __init__(
        self,
        run: _ClosedLoopRun,
        client: _Client,
        where: Mapping[str, tuple[int, int]],
        delay: float,
        seed: int,
    ) -> None:
        self.run, self.client, self.where, self.delay = run, client, where, delay
        self.seen: dict[str, tuple[float, float]] = {}  # request -> (first token, end) seen
        self._rng = random.Random(seed)
        self._first: dict[str, float] = {}  # request -> its first token seen (or due) at
        self._due: list[tuple[float, int, bool, str]] = []  # (at, order, is the end, request)
        self._order = 0

    def next_time(self) -> float:
        return self._due[0][0] if self._due else math.inf

    def first_token(self, request_id: str, at: float) -> None:
        """The engine made ``request_id``'s first token at ``at`` (a preempted request's
        second first token counts not: the router saw the first)."""
        if request_id in self._first:
            return
        seen = at + (self._rng.expovariate(1 / self.delay) if self.delay > 0 else 0.0)
        self._first[request_id] = seen
        self._deliver(seen, False, request_id)

    def finished(self, record: RequestRecord) -> None:
        """The engine ended ``record``'s request: seen to end then, or with its first token
        where that is seen later (the whole answer at once)."""
        first = self._first.pop(record.request_id, record.first_token_at)
        end = max(record.finished_at, first)
        self.seen[record.request_id] = (first, end)
        self._deliver(end, True, record.request_id)

    def due(self) -> None:
        """See the earliest delivery due."""
        at, _, end, request_id = heapq.heappop(self._due)
        self._see(at, end, request_id)

    def _deliver(self, at: float, end: bool, request_id: str) -> None:
        """Seen at once without a delay (as the step ends, before any other engine's next
        step), else when its time is due."""
        if self.delay <= 0:
            self._see(at, end, request_id)
            return
        heapq.heappush(self._due, (at, self._order, end, request_id))
        self._order += 1

    def _see(self, at: float, end: bool, request_id: str) -> None:
        if end:
            self._ended(request_id, at)
        else:
            self._answering(request_id)

    def _answering(self, request_id: str) -> None:
        flight = self.run.in_flight.get(request_id)
        if flight is not None:
            flight.answering = True

    def _ended(self, request_id: str, at: float) -> None:
        self.run.in_flight.pop(request_id, None)
        conversation, turn = self.where[request_id]
        self.client.answered(at, conversation, turn)


def _collect(
    engine: SimulatedEngine,
    worker: str,
    counted: tuple[dict[str, int], dict[str, int]],
    delivery: _Delivery,
) -> None:
    """After a step of ``worker``'s ``engine``: its requests whose first token came out and
    its finished requests, handed to ``delivery``. ``counted``: per worker, the finished
    requests and the first tokens already taken."""
    seen, first = counted
    for request_id in engine.first_tokens[first[worker] :]:
        delivery.first_token(request_id, engine.now)
    first[worker] = len(engine.first_tokens)
    finished = engine.finished_requests[seen[worker] :]
    seen[worker] = len(engine.finished_requests)
    for record in finished:
        delivery.finished(record)
