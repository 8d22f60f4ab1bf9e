"""A simulated inference engine that publishes faithful KV cache events.

It schedules requests the way vLLM's V1 scheduler does, in miniature: each attention-DP rank
has its own :class:`~kvevents.sim.RankCache`, waiting queue and per-step token budget
(chunked prefill); running requests go first, then waiting ones are admitted in order while
blocks and budget allow. A step computes prefill chunks and one decode token per running
request, commits every block that became full, finishes requests that reached their output
length (releasing their references once the step is over), and publishes one batch per rank
that changed.

Choices, documented in docs/engine.md; driven with the same requests at the same steps, the
engine's blocks and requests equal a real vLLM 0.32 engine's after every step:

- Full blocks made of generated tokens are cached and announced too (vLLM does the same), so
  multi-turn follow-ups hit them; ``cache_decode_blocks=False`` keeps them private.
- A prefix hit covers whole blocks of all the prompt's tokens but the last (an engine needs
  the last token's logits, so it computes it): a block-aligned prompt found whole in cache
  still computes its last block.
- A request is admitted only when its whole prompt fits in the rank's available blocks; when
  a running request later lacks a block, the newest running request is preempted (its blocks
  are released, it restarts from the waiting queue and re-hits its own cached prefix), the
  one lacking the block itself when it is the newest. A step that preempted admits nothing.
- A finished request's blocks are released once its last step is over: a request waiting for
  them is admitted at the next step (vLLM frees them when the step's output is processed).
- A block two requests compute at once is cached once (vLLM keeps both copies).
- Time: virtual by default (a step lasts ``step_base_s + step_token_s * tokens`` of the
  busiest rank; batch ``ts`` is ``start_time`` plus virtual time, so runs are reproducible).
  Pass ``clock=time.time`` for real time.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvevents.events import KVEventBatch
from kvevents.publish import EventRecorder, RecorderStats
from kvevents.sim._cache import CPU, GPU, CacheStats, RankCache
from kvevents.sim._hashing import HashStyle, engine_chain_hashes
from kvevents.sim._records import EngineMetrics, RankLoad, Request, RequestRecord, StepResult

if TYPE_CHECKING:
    from kvevents.config import KVEventsConfig
    from kvevents.publish import PublisherOptions

__all__ = [
    "BatchSink",
    "EngineConfig",
    "SimulatedEngine",
    "zmq_publisher_factory",
]


class BatchSink(Protocol):
    """Anything with ``publish(batch)``: a kvevents publisher, or a test's recording list."""

    def publish(self, batch: KVEventBatch) -> object: ...


#: Builds rank ``r``'s publisher for an engine of ``world_size`` ranks.
PublisherFactory = Callable[[int, int], BatchSink]


@dataclass(frozen=True)
class EngineConfig:
    """Shape and speed of a simulated engine. Capacities and budgets are per rank."""

    block_size: int = 16
    capacity_blocks: int = 4096
    cpu_capacity_blocks: int = 0
    ranks: int = 1
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cache_decode_blocks: bool = True
    hash_style: HashStyle = "unsigned"
    step_base_s: float = 0.004
    step_token_s: float = 0.00002
    start_time: float = 1_700_000_000.0

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "capacity_blocks",
            "ranks",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")


@dataclass(eq=False)  # identity: running-list membership must not compare token lists
class _Seq:
    request: Request
    rank: int
    tokens: list[int]
    prompt_len: int
    salt: bytes
    hashes: list[int] = field(default_factory=list)
    held: int = 0
    private: int = 0
    computed: int = 0
    generated: int = 0
    admitted_once: bool = False
    submitted_at: float = 0.0
    first_token_at: float | None = None
    cached_tokens: int = 0


@dataclasses.dataclass(slots=True)
class EngineCounts:
    """An engine's running counters (each documented on :class:`EngineMetrics`): mutable fields, so that a counter's name is
    checked by mypy; :meth:`frozen` makes the record."""

    steps: int = 0
    submitted: int = 0
    finished: int = 0
    rejected: int = 0
    preemptions: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    cpu_cached_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batches: int = 0
    events: int = 0


class SimulatedEngine:
    """An engine with ``config.ranks`` attention-DP ranks publishing through one sink each.

    Give ``publishers`` (one per rank, not owned: you start and stop them) or a
    ``publisher_factory(rank, world_size)`` (the engine owns what it builds: ``start()`` and
    ``close()``, or use it as a context manager). With neither, batches are only counted.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        publishers: Sequence[BatchSink] | None = None,
        publisher_factory: PublisherFactory | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self._owned = publisher_factory is not None
        self.publishers = _sinks(cfg.ranks, publishers, publisher_factory)
        self._clock = clock
        self.now = 0.0
        self.caches = [
            RankCache(
                cfg.capacity_blocks,
                cfg.block_size,
                cpu_capacity_blocks=cfg.cpu_capacity_blocks,
                rank=r,
                recorder=EventRecorder(cfg.block_size, rank=r, medium=GPU),
            )
            for r in range(cfg.ranks)
        ]
        self._waiting: list[deque[_Seq]] = [deque() for _ in range(cfg.ranks)]
        self._running: list[list[_Seq]] = [[] for _ in range(cfg.ranks)]
        self._counts = EngineCounts()
        #: A record per finished request, in finishing order (clear it freely).
        self.finished_requests: list[RequestRecord] = []
        #: The ids of the requests whose first token came out, in that order (clear it freely).
        self.first_tokens: list[str] = []
        self._first_tokens: list[_Seq] = []
        self._done: list[_Seq] = []
        self._finishing: list[_Seq] = []  # finished this step, blocks released at its end

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the publishers the engine built (no effect on ones passed in)."""
        if self._owned:
            for p in self.publishers or ():
                start = getattr(p, "start", None)
                if start is not None:
                    start()

    def close(self) -> None:
        """Shut down the publishers the engine built."""
        if self._owned:
            for p in self.publishers or ():
                shutdown = getattr(p, "shutdown", None)
                if shutdown is not None:
                    shutdown()

    def __enter__(self) -> SimulatedEngine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request, rank: int | None = None) -> int | None:
        """Queue ``request`` on ``rank`` (least loaded when None). Returns the rank, or None
        when the request can never fit (prompt plus output larger than a rank's capacity)."""
        cfg = self.config
        self._counts.submitted += 1
        total = len(request.token_ids) + max(1, request.max_output_tokens)
        if not request.token_ids or -(-total // cfg.block_size) > cfg.capacity_blocks:
            self._counts.rejected += 1
            return None
        if rank is None:
            rank = min(range(cfg.ranks), key=lambda r: (self._load_blocks(r), r))
        elif not 0 <= rank < cfg.ranks:
            raise ValueError(f"rank {rank} out of range for an engine of {cfg.ranks} ranks")
        salt = request.lora_name.encode() if request.lora_name else b""
        seq = _Seq(request, rank, list(request.token_ids), len(request.token_ids), salt)
        seq.submitted_at = self._time()
        self._waiting[rank].append(seq)
        return rank

    def _time(self) -> float:
        return self.now if self._clock is None else self._clock()

    def advance_to(self, seconds: float) -> None:
        """Move virtual time forward to ``seconds`` (an idle engine waiting for arrivals)."""
        self.now = max(self.now, seconds)

    def has_work(self) -> bool:
        """Whether any rank has waiting or running requests."""
        return any(self._waiting) or any(self._running)

    def step(self) -> StepResult:
        """Run one engine step on every rank and publish one batch per rank that changed."""
        finished: list[str] = []
        busiest = total = 0
        for rank in range(self.config.ranks):
            tokens = self._schedule(rank, finished)
            busiest = max(busiest, tokens)
            total += tokens
        if self._clock is None:
            self.now += self.config.step_base_s + self.config.step_token_s * busiest
        ts = self.config.start_time + self.now if self._clock is None else self._clock()
        self._stamp(self._time())
        batches = self._publish(ts)
        self._counts.steps += 1
        return StepResult(ts, total, finished, batches)

    def reset_cache(self, rank: int | None = None) -> bool:
        """Clear the cache of ``rank`` (every rank when None); refused while any is busy."""
        ranks = range(self.config.ranks) if rank is None else [rank]
        if any(self.caches[r].used_blocks for r in ranks):
            return False
        return all([self.caches[r].reset() for r in ranks])

    # ------------------------------------------------------------------ views

    def block_hashes(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[int]:
        """This engine's hashes of the full blocks of ``token_ids``."""
        salt = lora_name.encode() if lora_name else b""
        return engine_chain_hashes(
            token_ids, self.config.block_size, salt=salt, style=self.config.hash_style
        )

    def cached_prefix_blocks(
        self,
        token_ids: Sequence[int] | None = None,
        rank: int = 0,
        *,
        block_hashes: Sequence[int] | None = None,
        lora_name: str | None = None,
        medium: str = GPU,
    ) -> int:
        """The oracle's view: leading blocks of the prompt cached on ``rank`` right now.

        ``medium="CPU"`` counts blocks present on either tier (what a load-back would hit).
        """
        if block_hashes is None:
            if token_ids is None:
                raise ValueError("pass token_ids or block_hashes")
            block_hashes = self.block_hashes(token_ids, lora_name)
        cache = self.caches[rank]
        return cache.match_any_tier(block_hashes) if medium == CPU else cache.match(block_hashes)

    def cached_blocks(self, rank: int = 0, medium: str = GPU) -> set[int]:
        """Ground truth: the hashes cached on ``rank`` in ``medium``."""
        return self.caches[rank].cached_blocks(medium)

    def load(self, rank: int) -> RankLoad:
        cache = self.caches[rank]
        return RankLoad(
            rank=rank,
            waiting_requests=len(self._waiting[rank]),
            running_requests=len(self._running[rank]),
            queued_blocks=self._queued_blocks(rank),
            active_blocks=cache.used_blocks,
            free_blocks=cache.free_blocks,
            cached_blocks=cache.cached_count(GPU),
        )

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(**dataclasses.asdict(self._counts), virtual_time=self.now)

    def recorder_stats(self, rank: int) -> RecorderStats:
        return self.caches[rank].recorder.stats()

    def cache_stats(self, rank: int) -> CacheStats:
        return self.caches[rank].stats()

    # ------------------------------------------------------------------ scheduling

    def _schedule(self, rank: int, finished: list[str]) -> int:
        budget = self.config.max_num_batched_tokens
        running = self._running[rank]
        preempted = self._counts.preemptions
        for seq in list(running):
            if seq in running:  # an earlier seq of this step may have preempted it
                budget -= self._advance(seq, budget, finished)
        if self._counts.preemptions == preempted:  # a step that preempted admits nothing
            budget = self._admit(rank, budget, finished)
        # What finished this step gives its blocks back once the step is over: a request
        # waiting now is admitted into them at the next step, as in vLLM, whose scheduler
        # frees a request's blocks only when the step's output says it is done.
        for seq in self._finishing:
            self._release(seq)
        self._finishing.clear()
        return self.config.max_num_batched_tokens - budget

    def _admit(self, rank: int, budget: int, finished: list[str]) -> int:
        waiting, running, cache = self._waiting[rank], self._running[rank], self.caches[rank]
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            seq = waiting[0]
            self._extend_hashes(seq)
            bs = self.config.block_size
            if not cache.can_admit(self._hit_hashes(seq), -(-len(seq.tokens) // bs)):
                break
            waiting.popleft()
            self._start(seq)
            running.append(seq)
            budget -= self._advance(seq, budget, finished)
        return budget

    def _hit_hashes(self, seq: _Seq) -> list[int]:
        """The blocks a prefix hit may cover: whole blocks of all tokens but the last (the
        engine computes the last token for its logits, so a block-aligned prompt found whole
        still computes its last block)."""
        return seq.hashes[: (len(seq.tokens) - 1) // self.config.block_size]

    def _start(self, seq: _Seq) -> None:
        bs = self.config.block_size
        hit = self.caches[seq.rank].acquire(self._hit_hashes(seq))
        seq.held = hit.blocks
        seq.computed = hit.blocks * bs
        if not seq.admitted_once:
            seq.admitted_once = True
            gpu_tokens = min(hit.gpu_blocks * bs, seq.computed)
            self._counts.input_tokens += seq.prompt_len
            self._counts.cached_tokens += gpu_tokens
            self._counts.cpu_cached_tokens += seq.computed - gpu_tokens
            seq.cached_tokens = seq.computed

    def _advance(self, seq: _Seq, budget: int, finished: list[str]) -> int:
        """Compute up to ``budget`` tokens of ``seq``; returns the tokens computed."""
        chunk = self._fit(seq, min(len(seq.tokens) - seq.computed, budget))
        if chunk <= 0:
            return 0
        prefill = max(0, min(seq.computed + chunk, seq.prompt_len) - seq.computed)
        self._counts.prefill_tokens += prefill
        self._counts.decode_tokens += chunk - prefill
        seq.computed += chunk
        self._commit_full_blocks(seq)
        if seq.computed == len(seq.tokens):
            self._generate(seq, finished)
        return chunk

    def _fit(self, seq: _Seq, chunk: int) -> int:
        """Take the blocks ``chunk`` needs, preempting the newest running requests until they
        are free; when ``seq`` is the newest itself, it is preempted and 0 is returned (vLLM
        neither shrinks a chunk to the blocks left nor lets a request idle holding its own)."""
        bs, cache = self.config.block_size, self.caches[seq.rank]
        running = self._running[seq.rank]
        while chunk > 0:
            need = -(-(seq.computed + chunk) // bs) - seq.held - seq.private
            if cache.allocate(need):
                seq.private += max(0, need)
                return chunk
            victim = next(s for s in reversed(running) if s not in self._finishing)
            self._preempt(victim)
            if victim is seq:
                return 0
        return 0

    def _commit_full_blocks(self, seq: _Seq) -> None:
        bs, cache = self.config.block_size, self.caches[seq.rank]
        full = seq.computed // bs
        if not self.config.cache_decode_blocks:
            full = min(full, seq.prompt_len // bs)
        if full <= seq.held:
            return
        self._extend_hashes(seq)
        lora = seq.request
        for i in range(seq.held, full):
            parent = seq.hashes[i - 1] if i else None
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            cache.commit(
                seq.hashes[i], parent, tokens, lora_id=lora.lora_id, lora_name=lora.lora_name
            )
        seq.private -= full - seq.held
        seq.held = full

    def _extend_hashes(self, seq: _Seq) -> None:
        bs = self.config.block_size
        done = len(seq.hashes)
        if len(seq.tokens) // bs > done:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.extend(
                engine_chain_hashes(
                    seq.tokens[done * bs :],
                    bs,
                    parent=parent,
                    salt=seq.salt,
                    style=self.config.hash_style,
                )
            )

    def _generate(self, seq: _Seq, finished: list[str]) -> None:
        seq.generated += 1
        if seq.first_token_at is None:
            self._first_tokens.append(seq)
        if seq.generated >= max(1, seq.request.max_output_tokens):
            self._finish(seq)
            finished.append(seq.request.request_id)
            return
        given = seq.request.output_token_ids
        if seq.generated <= len(given):  # a replayed answer's own token
            seq.tokens.append(given[seq.generated - 1])
            return
        seed = zlib.crc32(seq.request.request_id.encode())
        seq.tokens.append((seed + 7919 * seq.generated) % 65536)

    def _release(self, seq: _Seq) -> None:
        self.caches[seq.rank].release(seq.hashes[: seq.held], seq.private)
        self._running[seq.rank].remove(seq)

    def _finish(self, seq: _Seq) -> None:
        self._finishing.append(seq)
        self._counts.finished += 1
        self._done.append(seq)

    def _stamp(self, end: float) -> None:
        """Tokens come out when the step ends, known only once every rank is scheduled."""
        for seq in self._first_tokens:
            seq.first_token_at = end
            self.first_tokens.append(seq.request.request_id)
        for seq in self._done:
            self.finished_requests.append(
                RequestRecord(
                    request_id=seq.request.request_id,
                    rank=seq.rank,
                    prompt_tokens=seq.prompt_len,
                    cached_tokens=seq.cached_tokens,
                    output_tokens=seq.generated,
                    submitted_at=seq.submitted_at,
                    first_token_at=end if seq.first_token_at is None else seq.first_token_at,
                    finished_at=end,
                )
            )
        self._first_tokens.clear()
        self._done.clear()

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        self._counts.preemptions += 1
        seq.held = seq.private = seq.computed = 0
        self._waiting[seq.rank].appendleft(seq)

    def _publish(self, ts: float) -> list[KVEventBatch]:
        batches = []
        for rank, cache in enumerate(self.caches):
            batch = cache.recorder.flush(ts)
            if batch is None:
                continue
            batches.append(batch)
            self._counts.batches += 1
            self._counts.events += len(batch.events)
            if self.publishers is not None:
                self.publishers[rank].publish(batch)
        return batches

    # ------------------------------------------------------------------ load

    def _queued_blocks(self, rank: int) -> int:
        """Prefill still to compute, in blocks: waiting prompts whole, and the part of running
        prompts not computed yet (chunked prefill spreads a long prompt over many steps)."""
        bs = self.config.block_size
        waiting = sum(-(-len(s.tokens) // bs) for s in self._waiting[rank])
        pending = sum(
            -(-(s.prompt_len - s.computed) // bs)
            for s in self._running[rank]
            if s.computed < s.prompt_len
        )
        return waiting + pending

    def _load_blocks(self, rank: int) -> int:
        return self._queued_blocks(rank) + self.caches[rank].used_blocks


def _sinks(
    ranks: int, publishers: Sequence[BatchSink] | None, factory: PublisherFactory | None
) -> list[BatchSink] | None:
    if publishers is not None and factory is not None:
        raise ValueError("pass publishers or publisher_factory, not both")
    if factory is not None:
        return [factory(r, ranks) for r in range(ranks)]
    if publishers is not None and len(publishers) != ranks:
        raise ValueError(f"{len(publishers)} publishers for {ranks} ranks")
    return None if publishers is None else list(publishers)


def zmq_publisher_factory(
    kv_config: KVEventsConfig, options: PublisherOptions | None = None
) -> PublisherFactory:
    """A factory that builds ``kvevents.publish.create_publisher(config, rank=r, ...)``."""

    def build(rank: int, world_size: int) -> BatchSink:
        from kvevents.publish import create_publisher

        made: BatchSink = create_publisher(kv_config, rank, world_size=world_size, options=options)
        return made

    return build
