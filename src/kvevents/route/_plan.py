"""The front door's planner: a request's exact tokens, the index's matches and the front
door's own view of load in, the engines to try out.

For each chat or completion request (:class:`~kvevents.route.RouteRequest`):

1. **Tokens.** The served model's :class:`~kvevents.route.ModelTokenizer` gives the
   prompt's ids as the engine will see them (a large body is tokenized on the tokenizer's
   own thread, which releases the GIL, so other requests' bytes keep moving). What cannot be
   exact in process is asked of **one** engine's ``/tokenize`` (the least loaded); what has
   no ids at all (refused, embeddings) and multimodal requests are routed on load alone, with
   no cache credit: an item the router cannot key is a miss, never a false hit.
2. **Keys.** The engine's keys: the request's ``cache_salt``, and the LoRA adapter a
   ``model`` names (the engines list adapters in ``GET /v1/models`` with their base model as
   ``parent``; their prompts use the base model's tokenizer).
3. **Matches.** The index's matched blocks per target, each raised to the blocks predicted
   there (:mod:`kvevents.route._predict`: prompts sent and not yet announced). A target whose
   events stopped (an answered request was not followed by a batch from its stream within
   ``stale_after`` seconds), or whose stream the subscriber reported incomplete, gets no
   credit: routing there goes on load alone, and the planner says so (a log line, its stats,
   ``/health``).
4. **Decision.** The index service's router, with the policy, over the healthy engines
   serving the model, on the loads the front door keeps itself (:mod:`kvevents.route.
   _inflight`: requests in flight, their prefill still queued, the blocks past their first
   token). The candidates are the targets by score, best first; each one's predicted cached
   tokens are what vLLM would serve from the matched blocks (never the prompt's last token).

When an attempt starts, its load is charged and its prompt's blocks credited to that
target; when its answer begins, its prefill is done; when it ends, its load goes, its credit
lasts a grace period (or goes at once if the attempt failed), and the engine's reported
``cached_tokens`` is compared with the prediction. An engine that served fewer than predicted
after announcing at least as many blocks removed while the request was in flight as it came
short lost them to an eviction race (its cache full, blocks the decision counted on evicted
before the prefill): counted as ``evicted``, apart from the mismatches a wrong tokenizer,
template or block size makes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import msgspec

from kvevents._types import Document, DocumentView
from kvevents.events import StreamKey
from kvevents.index import DEFAULT_RECENT_WINDOW, Decision, MatchResult, request_keys
from kvevents.route._client import EngineClient, UpstreamError
from kvevents.route._engines import Engine, EnginePool
from kvevents.route._inflight import InFlight, Ticket
from kvevents.route._predict import Credit, Predictions
from kvevents.route._seam import Outcome, Plan, RouteRequest
from kvevents.route._tokens import ModelTokenizer, Prompt, parse_tokenize_reply, tokenize_request
from kvevents.service import IndexService

__all__ = [
    "DEFAULT_ROUTE_POLICY",
    "IndexPlanner",
    "PlannerCounts",
    "PlannerLevels",
    "PlannerOptions",
    "PlannerStats",
]

log = logging.getLogger("kvevents.route.plan")

#: The front door's policy unless told otherwise (docs/route.md says how it was chosen).
DEFAULT_ROUTE_POLICY = "bounded_prefix"
_CHAT = "/v1/chat/completions"
#: Decisions kept for the status page.
RECENT_DECISIONS = 50
#: Bytes of a decision header at most: with many engines the matched list would grow past
#: what proxies in between accept in a header (8 KiB is a common limit for all of them).
_HEADER_LIMIT = 2048
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class PlannerOptions:
    """How the planner decides.

    ``policy``: the routing policy (:data:`kvevents.index.POLICIES`).
    ``block_size``: the engines' block size where their streams have not said (an engine
    routed without events). ``offload_bytes``: bodies at least this large are tokenized on
    the tokenizer thread. ``tokenize_timeout``: seconds for the one ``/tokenize`` call.
    ``stale_after``: seconds after an answered request that stored a block (as its usage
    says, or one that did not say) by which its engine's events must have reached the index
    (else its stream is stale and gets no cache credit until they come). ``grace``: seconds
    a request's predicted blocks outlive it. ``recent_window``: seconds the blocks of a
    request sent to a target count in its footprint (the load's ``recent_blocks``:
    :class:`kvevents.index.RecentBlocks`).
    """

    policy: str = DEFAULT_ROUTE_POLICY
    block_size: int = 16
    offload_bytes: int = 16 << 10
    tokenize_timeout: float = 5.0
    stale_after: float = 5.0
    grace: float = 2.0
    recent_window: float = DEFAULT_RECENT_WINDOW

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.offload_bytes < 0:
            raise ValueError("block_size must be >= 1 and offload_bytes >= 0")
        if not (self.tokenize_timeout > 0 and self.stale_after > 0 and self.grace >= 0):
            raise ValueError("tokenize_timeout and stale_after must be > 0, grace >= 0")
        if not self.recent_window > 0:
            raise ValueError("recent_window must be > 0")


@dataclass
class PlannerCounts:
    """What the planner did (``kvevents_route_planner_*`` metrics)."""

    planned: int = 0  #: requests planned
    tokens_chat: int = 0  #: prompts rendered and encoded in process (chats)
    tokens_completion: int = 0  #: prompts encoded in process (completion text)
    tokens_given: int = 0  #: prompts given as token ids
    tokens_fallback: int = 0  #: prompts whose ids came from one engine's /tokenize
    tokens_none: int = 0  #: prompts routed with no ids (refused, embeddings, /tokenize failed)
    multimodal: int = 0  #: requests with media parts: routed with no cache credit
    tokenize_calls: int = 0  #: /tokenize calls made (one engine each)
    tokenize_errors: int = 0  #: /tokenize calls that failed
    compared: int = 0  #: answers whose usage reported cached tokens to compare
    exact: int = 0  #: of those, predicted == reported
    over: int = 0  #: predicted more than the engine reported
    #: of those, the ones the engine's evictions while the request was in flight account for
    #: (it announced at least as many blocks removed as the request came short): an eviction
    #: race, not a mismatch of tokens, template or block size
    evicted: int = 0
    #: requests sent with fewer blocks predicted than matched: blocks the requests ahead of
    #: them on their engine will evict before their prefill (:meth:`InFlight.surviving`)
    foreseen_evictions: int = 0
    under: int = 0  #: predicted less than the engine reported
    #: of those, the ones the forecast accounts for: it gave up blocks to the requests ahead
    #: (:attr:`foreseen_evictions`) that the engine still had, and no more than were matched
    kept_foreseen: int = 0
    predicted_tokens: int = 0  #: predicted cached tokens of the compared answers
    reported_tokens: int = 0  #: cached tokens the engines reported for them
    prompt_tokens: int = 0  #: prompt tokens the engines reported for them
    stale_marks: int = 0  #: times a stream was found stale (its events stopped coming)


@dataclass(frozen=True)
class PlannerLevels:
    """The planner's levels now (``kvevents_route_planner_*`` gauges)."""

    GAUGES: ClassVar[frozenset[str]] = frozenset({"stale_streams", "predicted_keys"})

    stale_streams: int  #: streams getting no cache credit because their events stopped
    predicted_keys: int  #: block keys credited to engines by requests in flight or just ended


@dataclass(frozen=True)
class PlannerStats:
    """The planner now: its levels and a copy of its counts."""

    levels: PlannerLevels
    counts: PlannerCounts


@dataclass(eq=False)
class _Planned:
    """One request's plan, as the planner keeps it (the plan's ``context``)."""

    targets: dict[str, StreamKey]  # engine id -> its target
    request_blocks: dict[str, int]  # engine id -> the prompt's full blocks there
    matched: dict[str, int]  # engine id -> blocks trusted there (index or predicted)
    keys: dict[str, list[int]]  # engine id -> the prompt's block keys there
    predicted: dict[str, int]  # engine id -> predicted cached tokens
    tokens: int = 0  # the prompt's tokens
    #: engine id -> of its matched blocks, the ones its prefill will find, as foreseen when
    #: the request was sent there (:meth:`IndexPlanner.started`)
    found: dict[str, int] = field(default_factory=dict)
    #: engine id -> its attempt: ticket, credit, blocks its engine had removed when it began
    attempts: dict[str, tuple[Ticket, Credit | None, int]] = field(default_factory=dict)
    record: Document = field(default_factory=dict)  # what the status page shows of it
    #: What its explanation is made of, until it is made (:meth:`IndexPlanner._explained`):
    #: the decision, the prompts, the matches, the streams then stale.
    unexplained: tuple[Decision, Sequence[Prompt], _Matches, dict[StreamKey, str]] | None = None


@dataclass
class _Watch:
    """A stream expected to show a batch: by ``deadline``, more than ``batches`` applied."""

    deadline: float
    batches: int


class IndexPlanner:
    """The front door's planner (module docstring) over ``service`` and ``pool``.

    ``tokenizers``: model name -> its tokenizer (LoRA adapters use their base model's; a
    tokenizer under None serves any model without one of its own). ``targets``: engine id ->
    its (worker, rank) in the index (each engine of the pool has one). ``block_sizes``: the
    targets whose block size is not ``options.block_size``. ``inflight`` keeps its loads in
    the book of the service's router.
    """

    def __init__(
        self,
        service: IndexService,
        pool: EnginePool,
        tokenizers: Mapping[str | None, ModelTokenizer],
        targets: Mapping[str, StreamKey],
        *,
        options: PlannerOptions | None = None,
        block_sizes: Mapping[StreamKey, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.block_sizes = dict(block_sizes or {})
        self.pool = pool
        self.tokenizers = dict(tokenizers)
        self.targets = dict(targets)
        self.options = options if options is not None else PlannerOptions()
        self.inflight = InFlight(
            service.router.loads,
            clock,
            self.options.recent_window,
            capacity=service.router.capacity,
        )
        self.predictions = Predictions(grace=self.options.grace, clock=clock)
        self.counts = PlannerCounts()
        self.stale: dict[StreamKey, str] = {}
        self._watch: dict[StreamKey, _Watch] = {}
        self._clock = clock
        self._checked = 0.0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvevents-tokenizer")
        self._client = EngineClient()
        #: The last plans, newest last (:meth:`decisions` says what each said and what its
        #: engine reported).
        self.recent: deque[Plan] = deque(maxlen=RECENT_DECISIONS)
        pool.subscribe(self._engine_changed)

    # ------------------------------------------------------------------ the seam

    async def plan(self, request: RouteRequest) -> Plan:
        self.counts.planned += 1
        engines = self.pool.healthy(request.model)
        error = self.pool.unavailable(request.model)
        if error is not None:
            return Plan((), {}, {"reason": str(error)}, error=(error.status, error.body))
        self._check_streams()
        tokenizer = self._tokenizer(request.model, engines)
        prompts = await self._prompts(request, engines, tokenizer)
        lora = self._lora(request.model, engines)
        salt = request.json.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        count = None if tokenizer is None else tokenizer.count
        return self._decide(engines, prompts, lora, salt, count)

    def started(self, plan: Plan, engine: Engine) -> None:
        planned = plan.context
        if not isinstance(planned, _Planned):
            return
        target = self.targets.get(engine.id)
        if target is not None and engine.id in planned.matched:
            self._foresee(planned, engine.id, target)
        self._explained(plan)
        if target is None:
            return
        blocks = planned.request_blocks.get(engine.id, 0)
        matched = planned.matched.get(engine.id, 0)
        keys = planned.keys.get(engine.id)
        ticket = self.inflight.sent(target, blocks, blocks - matched, keys or ())
        credit = self.predictions.credit(target, keys) if keys else None
        planned.attempts[engine.id] = (ticket, credit, self.service.removed_blocks(*target))

    def answering(self, plan: Plan, engine: Engine) -> None:
        planned = plan.context
        if isinstance(planned, _Planned) and engine.id in planned.attempts:
            self.inflight.first_byte(planned.attempts[engine.id][0])

    def finished(self, plan: Plan, engine: Engine, outcome: Outcome) -> None:
        planned = plan.context
        if not isinstance(planned, _Planned) or engine.id not in planned.attempts:
            return
        ticket, credit, removed = planned.attempts.pop(engine.id)
        size = self._block_size(ticket.target)
        self.inflight.ended(ticket, _unkeyed(ticket, outcome, size))
        answered = outcome.first_byte_s is not None
        if credit is not None:
            self.predictions.settle(credit, stored=answered)
        if answered and outcome.kind == "ok" and _stored_blocks(outcome, size):
            self._expect_events(ticket.target)
        planned.record.update(sent_to=engine.id, status=outcome.status, outcome=outcome.kind)
        if outcome.cached_tokens is not None:
            planned.record["reported_cached_tokens"] = outcome.cached_tokens
            predicted = planned.predicted.get(engine.id, 0)
            matched = _hit(planned.matched.get(engine.id, 0), planned.tokens, size)
            why = self._compare(predicted, matched, outcome, ticket.target, size, removed)
            if why is not None:
                planned.record[why] = True

    # ------------------------------------------------------------------ tokens

    async def _prompts(
        self, request: RouteRequest, engines: Sequence[Engine], tokenizer: ModelTokenizer | None
    ) -> list[Prompt]:
        if tokenizer is None:
            return [Prompt(None, "none", f"no tokenizer for model {request.model!r}")]
        chat = request.path == _CHAT
        if len(request.body) >= self.options.offload_bytes:
            loop = asyncio.get_running_loop()
            prompts = await loop.run_in_executor(self._thread, _tokens, tokenizer, request, chat)
        else:
            prompts = _tokens(tokenizer, request, chat)
        resolved = [await self._resolved(p, i, request, engines) for i, p in enumerate(prompts)]
        for prompt in resolved:
            self._count_source(prompt)
        return resolved

    def _tokenizer(self, model: str | None, engines: Sequence[Engine]) -> ModelTokenizer | None:
        found = self.tokenizers.get(model)
        if found is None and model is not None:
            parent = _parent(model, engines)
            found = self.tokenizers.get(parent) if parent is not None else None
        return found if found is not None else self.tokenizers.get(None)

    async def _resolved(
        self, prompt: Prompt, index: int, request: RouteRequest, engines: Sequence[Engine]
    ) -> Prompt:
        """``prompt``, with its ids from one engine's /tokenize when it needs them (not for a
        multimodal one: its ids would not make the engine's keys, so it gets no credit)."""
        if prompt.source != "fallback" or prompt.multimodal or not engines:
            return prompt
        kind: Literal["chat", "completion"] = "chat" if request.path == _CHAT else "completion"
        try:
            body = tokenize_request(request.json, kind, index=index)
        except ValueError as exc:
            return Prompt(None, "none", str(exc), multimodal=prompt.multimodal)
        engine = min(engines, key=lambda e: e.in_flight)  # one engine, the least loaded
        ids = await self._tokenize(engine, body)
        if ids is None:
            return Prompt(None, "none", f"/tokenize on {engine.id} failed", prompt.multimodal)
        return Prompt(ids, "fallback", prompt.why, multimodal=prompt.multimodal)

    async def _tokenize(self, engine: Engine, body: bytes) -> list[int] | None:
        self.counts.tokenize_calls += 1
        headers = [("content-type", "application/json")]
        try:
            _, data = await self._client.fetch(
                engine.url + "/tokenize",
                "POST",
                body,
                headers,
                timeout=self.options.tokenize_timeout,
            )
            return parse_tokenize_reply(data)  # an error answer says what is wrong
        except (UpstreamError, ValueError) as exc:
            self.counts.tokenize_errors += 1
            log.warning("/tokenize on %s failed: %s", engine.id, exc)
            return None

    def _count_source(self, prompt: Prompt) -> None:
        counts = self.counts
        if prompt.multimodal:
            counts.multimodal += 1
        if prompt.token_ids is None:
            counts.tokens_none += 1
        elif prompt.source == "chat":
            counts.tokens_chat += 1
        elif prompt.source == "completion":
            counts.tokens_completion += 1
        elif prompt.source == "tokens":
            counts.tokens_given += 1
        else:
            counts.tokens_fallback += 1

    def _lora(self, model: str | None, engines: Sequence[Engine]) -> str | None:
        """The LoRA adapter ``model`` names (the engines list it with a parent model)."""
        if model is None:
            return None
        parent = _parent(model, engines)
        return model if parent is not None and parent != model else None

    # ------------------------------------------------------------------ the decision

    def _decide(
        self,
        engines: Sequence[Engine],
        prompts: Sequence[Prompt],
        lora: str | None,
        salt: str | None,
        count: Callable[[str], int] | None = None,
    ) -> Plan:
        mine = [e for e in engines if e.id in self.targets]
        targets = {e.id: self.targets[e.id] for e in mine}
        sizes = {target: self._block_size(target) for target in targets.values()}
        prompt = prompts[0] if prompts else Prompt(None, "none", "no prompt")
        ids = None if prompt.multimodal else prompt.token_ids
        match = self._match(ids, sizes, lora, salt)
        self.inflight.refresh()
        adds = {t: self.inflight.adds(t, match.keys.get(size, ())) for t, size in sizes.items()}
        recent = self.inflight.recent
        lately = {t: recent.prefix(t, match.keys.get(size, ())) for t, size in sizes.items()}
        decision = self.service.decide(
            match.result,
            targets=list(sizes),
            policy=self.options.policy,
            adds=adds,
            recent_matched=lately,
            credit=match.credit,
        )
        order = _by_score(decision, mine, targets)
        tokens = len(ids) if ids is not None else 0
        planned = _Planned(targets, {}, {}, {}, {}, tokens)
        trusted = decision.matched  # a degraded stream's matches count 0 there
        for engine in mine:
            target = targets[engine.id]
            self._fill(planned, engine.id, sizes[target], trusted.get(target, 0), match)
        planned.record = {"time": time.time()}
        planned.unexplained = (decision, prompts, match, dict(self.stale))
        plan = Plan(
            order,
            planned.predicted,  # each engine's revised when a request is sent there
            {},
            context=planned,
            prompt_tokens=len(ids) if ids is not None and len(prompts) == 1 else None,
            count_tokens=count,
        )
        self.recent.append(plan)
        if not order:  # no attempt follows: nothing to explain it alongside
            self._explained(plan)
        return plan

    def decisions(self) -> list[Document]:
        """The last decisions, newest first: what each plan said and what its engine
        reported."""
        return [self._explained(plan) for plan in reversed(self.recent)]

    def _explained(self, plan: Plan) -> Document:
        """The plan's record, its explanation (``plan.explain``, ``plan.headers``, the debug
        log) made now if it was not yet: a decision is explained once its request is on its
        way (:meth:`started`), while the engine works, not before it is sent."""
        planned = plan.context
        assert isinstance(planned, _Planned)
        if planned.unexplained is not None:
            decision, prompts, match, stale = planned.unexplained
            planned.unexplained = None
            explain = self._explain(decision, prompts, match, planned, stale)
            log.debug("plan: %s", explain)
            planned.record.update(explain)
            plan.explain, plan.headers = explain, _headers(explain)
        return planned.record

    def _match(
        self,
        ids: Sequence[int] | None,
        targets: Mapping[StreamKey, int],
        lora: str | None,
        salt: str | None,
    ) -> _Matches:
        """``ids``' matches on ``targets`` (each with its block size)."""
        if ids is None:
            return _Matches(MatchResult(0, {}), {}, {})
        result = self.service.match(ids, lora=lora, cache_salt=salt)
        keys: dict[int, list[int]] = {}
        predicted: dict[StreamKey, int] = {}
        credit: dict[StreamKey, int] = {}
        streams = dict(result.streams)
        sizes = dict(result.request_blocks)
        for target, size in targets.items():
            sizes.setdefault(size, len(ids) // size)
            if size not in keys:
                keys[size] = request_keys(ids, size, lora=lora, cache_salt=salt)
            credited = self.predictions.prefix(target, keys[size])
            predicted[target] = credited
            if target in self.stale:
                streams.pop(target, None)
            else:
                credit[target] = credited
        # The index's matches (which the router ignores on a degraded stream: one replaying
        # or incomplete) and the front door's own credits (which it does not) go apart.
        merged = MatchResult(result.request_tokens or len(ids), sizes, result.holders, streams)
        return _Matches(merged, keys, predicted, result.streams, credit)

    def _block_size(self, target: StreamKey) -> int:
        """The target's block size: as given for its engine, else its stream's, else the
        engines' default."""
        given = self.block_sizes.get(target)
        return given or self.service.block_size(*target) or self.options.block_size

    @staticmethod
    def _fill(planned: _Planned, engine_id: str, size: int, trusted: int, match: _Matches) -> None:
        planned.request_blocks[engine_id] = planned.tokens // size
        planned.matched[engine_id] = trusted
        planned.keys[engine_id] = match.keys.get(size, [])
        planned.predicted[engine_id] = _hit(trusted, planned.tokens, size)

    def _foresee(self, planned: _Planned, engine_id: str, target: StreamKey) -> None:
        """The prediction for the engine a request is about to be sent to: of its matched
        blocks, the ones its prefill will find there (:meth:`InFlight.surviving`: what the
        requests already in flight there will evict first). Made as the request leaves, on
        the state it leaves behind, and for that engine alone (the others' predictions stay
        their matched blocks)."""
        matched = planned.matched.get(engine_id, 0)
        found = self.inflight.surviving(target, planned.keys.get(engine_id, ()), matched)
        planned.found[engine_id] = found
        planned.predicted[engine_id] = _hit(found, planned.tokens, self._block_size(target))
        if found < matched:
            self.counts.foreseen_evictions += 1

    @staticmethod
    def _explain(
        decision: Decision,
        prompts: Sequence[Prompt],
        match: _Matches,
        planned: _Planned,
        stale: Mapping[StreamKey, str],
    ) -> Document:
        by_target = {target: engine_id for engine_id, target in planned.targets.items()}
        rows = []
        for row in decision.scores:
            target = (row.worker_id, row.rank)
            engine_id = by_target.get(target, row.worker_id)
            rows.append(
                {
                    "engine": engine_id,
                    "matched_blocks": row.matched_blocks,
                    "indexed_blocks": match.indexed.get(target, 0),
                    "predicted_blocks": match.predicted.get(target, 0),
                    "request_blocks": row.request_blocks,
                    "requests": row.load.requests,
                    "terms": dict(row.terms),
                    "degraded": row.degraded or stale.get(target),
                    "prefill_hit_blocks": planned.found.get(engine_id),
                    "predicted_cached_tokens": planned.predicted.get(engine_id, 0),
                }
            )
        winner = decision.winner
        first = prompts[0] if prompts else None
        return {
            "policy": decision.policy,
            "winner": None if winner is None else by_target.get(winner, winner[0]),
            "reason": decision.reason,
            "tokens": {
                "source": None if first is None else first.source,
                "count": 0 if first is None or first.token_ids is None else len(first.token_ids),
                "why": None if first is None else first.why,
                "prompts": len(prompts),
            },
            "scores": rows,
        }

    # ------------------------------------------------------------------ what the engines said

    def _compare(
        self,
        predicted: int,
        matched: int,
        outcome: Outcome,
        target: StreamKey,
        size: int,
        removed: int,
    ) -> Literal["eviction_race", "kept_foreseen"] | None:
        """Count one answer's prediction against its engine's report (``matched``: the cached
        tokens its matched blocks would have given; ``size``: the target's block size;
        ``removed``: the blocks its engine had announced removed when it was sent). What
        explains a miss, where something does: an eviction race, or blocks the engine kept
        that the forecast gave up to the requests ahead (no more than were matched)."""
        reported = outcome.cached_tokens or 0
        counts = self.counts
        counts.compared += 1
        counts.predicted_tokens += predicted
        counts.reported_tokens += reported
        counts.prompt_tokens += outcome.prompt_tokens or 0
        if predicted == reported:
            counts.exact += 1
        elif predicted < reported:
            counts.under += 1
            if reported <= matched:
                counts.kept_foreseen += 1
                return "kept_foreseen"
        else:
            counts.over += 1
            short = -(-(predicted - reported) // size)
            if self.service.removed_blocks(*target) - removed >= short:
                counts.evicted += 1
                return "eviction_race"
        return None

    def _expect_events(self, target: StreamKey) -> None:
        """An answered request: its engine stored blocks, so its stream must show a batch
        within ``stale_after`` (kept from the first such request until one arrives)."""
        if target in self._watch or not self._has_stream(target):
            return
        batches = self._batches().get(target, 0)
        self._watch[target] = _Watch(self._clock() + self.options.stale_after, batches)

    def _check_streams(self) -> None:
        """Streams watched for events: cleared when a batch came, stale when none did in time
        (checked at most every half second, from the event loop)."""
        now = self._clock()
        if now - self._checked < 0.5 or not (self._watch or self.stale):
            return
        self._checked = now
        batches = self._batches()
        for target, watch in list(self._watch.items()):
            if batches.get(target, 0) > watch.batches:
                del self._watch[target]
                self._fresh(target)
            elif now >= watch.deadline:
                self._mark_stale(target, watch)
        for target in [t for t in self.stale if t not in self._watch]:
            self._fresh(target)

    def _mark_stale(self, target: StreamKey, watch: _Watch) -> None:
        if target in self.stale:
            return
        why = f"no events within {self.options.stale_after:g} s of an answered request"
        self.stale[target] = why
        self.counts.stale_marks += 1
        self.predictions.forget(*target)
        log.warning(
            "worker %s rank %d: %s; routed on load alone until its events come", *target, why
        )

    def _fresh(self, target: StreamKey) -> None:
        if self.stale.pop(target, None) is not None:
            log.warning("worker %s rank %d: its events come again", *target)

    def _has_stream(self, target: StreamKey) -> bool:
        return any(reg.worker_id == target[0] for reg in self.service.workers())

    def _batches(self) -> dict[StreamKey, int]:
        return {(s.worker_id, s.rank): s.batches for s in self.service.stream_infos()}

    def _engine_changed(self, engine: Engine) -> None:
        """An engine that went down loses its predicted blocks (it may come back empty); one
        that came up bounds its target by its cache, where its size is known."""
        target = self.targets.get(engine.id)
        if target is None:
            return
        if engine.up:
            self.service.set_capacity(*target, engine.cache_blocks)
            return
        self.predictions.forget(*target)
        self.inflight.forget(*target)
        self._watch.pop(target, None)

    # ------------------------------------------------------------------ stats

    def stats(self) -> PlannerStats:
        levels = PlannerLevels(len(self.stale), self.predictions.stats().keys_held)
        return PlannerStats(levels, PlannerCounts(**vars(self.counts)))

    async def aclose(self) -> None:
        """Close the /tokenize connections and the tokenizer thread."""
        await self._client.aclose()
        self._thread.shutdown(wait=False)


@dataclass(frozen=True)
class _Matches:
    """A request's matches: the index's result, its keys per block size, the blocks credited
    by predictions and those the index alone matched, per target."""

    result: MatchResult
    keys: Mapping[int, list[int]]
    predicted: Mapping[StreamKey, int]
    indexed: Mapping[StreamKey, int] = field(default_factory=dict)
    #: the predicted blocks that count, per target (none on a stale stream's)
    credit: Mapping[StreamKey, int] = field(default_factory=dict)


def _headers(explain: DocumentView) -> list[tuple[bytes, bytes]]:
    """The decision for the client: matched blocks per engine (``e0=12, e1=3``), the policy
    and why the winner won (ASCII: engine ids and reasons are made of it; others dropped)."""
    matched = ", ".join(f"{row['engine']}={row['matched_blocks']}" for row in explain["scores"])
    out = []
    for name, text in (
        (b"x-kvevents-matched-blocks", matched),
        (b"x-kvevents-policy", str(explain["policy"])),
        (b"x-kvevents-reason", str(explain["reason"])),
    ):
        value = text.encode("ascii", "ignore").replace(b"\r", b" ").replace(b"\n", b" ")
        out.append((name, value[:_HEADER_LIMIT]))
    return out


def _tokens(tokenizer: ModelTokenizer, request: RouteRequest, chat: bool) -> list[Prompt]:
    if chat:
        return [tokenizer.chat(request.json)]
    return tokenizer.completion(request.json)


def _hit(blocks: int, tokens: int, size: int) -> int:
    """The cached tokens vLLM serves from ``blocks`` of a ``tokens``-token prompt: never its
    last token, which it computes whatever is cached."""
    return min(blocks, (tokens - 1) // size) * size if tokens else 0


def _unkeyed(ticket: Ticket, outcome: Outcome, size: int) -> int:
    """The blocks an ended request held that have no key here: its answer's and its prompt's
    partial last block (the prompt and answer as its usage says, less the answer's last
    token, which the engine never ran; one when it did not say, none when no answer began:
    nothing was computed)."""
    if outcome.first_byte_s is None:
        return 0
    if outcome.prompt_tokens is None or outcome.completion_tokens is None:
        return 1
    computed = _computed(outcome.prompt_tokens, outcome.completion_tokens)
    return max(0, -(-computed // size) - ticket.request_blocks)


def _computed(prompt_tokens: int, completion_tokens: int) -> int:
    """The tokens an engine computed for a request: its prompt and its answer but the
    answer's last token, which it never ran."""
    return prompt_tokens + max(0, completion_tokens - 1)


def _stored_blocks(outcome: Outcome, size: int) -> bool:
    """Whether the engine stored a block for an answered request, so that its stream must
    show a batch: what it computed (:func:`_computed`) filled a block past the ones it found
    cached, as its usage says; True where it did not say. A request found whole in the cache
    with an answer too short to fill a block stores nothing, and waiting for its events would
    mark a healthy stream stale."""
    if outcome.prompt_tokens is None or outcome.cached_tokens is None:
        return True
    computed = _computed(outcome.prompt_tokens, outcome.completion_tokens or 0)
    return computed // size > outcome.cached_tokens // size


def _parent(model: str, engines: Sequence[Engine]) -> str | None:
    """The base model of ``model`` as an engine lists it (``parent``), else None."""
    for engine in engines:
        for card in engine.cards:
            entry = msgspec.json.decode(card)
            if isinstance(entry, dict) and entry.get("id") == model:
                parent = entry.get("parent")
                return parent if isinstance(parent, str) else None
    return None


def _by_score(
    decision: Decision, engines: Sequence[Engine], targets: Mapping[str, StreamKey]
) -> list[Engine]:
    """The engines best first: the winner, then by score (a stable order for equal ones)."""
    score = {(s.worker_id, s.rank): s.score for s in decision.scores}
    winner = decision.winner

    def key(engine: Engine) -> tuple[bool, float]:
        target = targets[engine.id]
        return (target != winner, -score.get(target, 0.0))

    return sorted(engines, key=key)
