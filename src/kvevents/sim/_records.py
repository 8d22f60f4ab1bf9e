"""What a simulated engine takes and reports: requests, per-rank load, counters, finished
requests and step results. Plain frozen records, no behaviour."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvevents.events import KVEventBatch

__all__ = ["EngineMetrics", "RankLoad", "Request", "RequestRecord", "StepResult"]


@dataclass(frozen=True)
class Request:
    """A request to serve: its prompt, how many tokens to generate, an optional LoRA, and
    optionally the tokens it generates (``output_token_ids``: a replayed answer, as far as it
    goes, which a later turn's prompt may hold; the simulator's own tokens past it)."""

    request_id: str
    token_ids: Sequence[int]
    max_output_tokens: int = 1
    lora_id: int | None = None
    lora_name: str | None = None
    output_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class RankLoad:
    """One rank's load, as a router would weigh it."""

    rank: int
    waiting_requests: int
    running_requests: int
    queued_blocks: int
    """Prefill still to compute, in blocks: waiting prompts, and running prompts' rest."""
    active_blocks: int
    """Blocks referenced by running requests."""
    free_blocks: int
    cached_blocks: int


@dataclass(frozen=True)
class EngineMetrics:
    """Counters of one engine since construction (all ranks)."""

    steps: int = 0
    virtual_time: float = 0.0
    submitted: int = 0
    finished: int = 0
    rejected: int = 0
    preemptions: int = 0
    input_tokens: int = 0
    """Prompt tokens of admitted requests (counted once per request)."""
    cached_tokens: int = 0
    """Prompt tokens served from GPU prefix blocks at first admission."""
    cpu_cached_tokens: int = 0
    """Prompt tokens served from CPU-tier blocks loaded back at first admission."""
    prefill_tokens: int = 0
    """Prompt tokens computed (recomputation after preemption included)."""
    decode_tokens: int = 0
    batches: int = 0
    events: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, for routing evaluations. Times are engine seconds (virtual time,
    or the clock's time when one is given): submitted, first token, finished."""

    request_id: str
    rank: int
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from cache (either tier) at first admission."""
    output_tokens: int
    submitted_at: float
    first_token_at: float
    finished_at: float

    @property
    def time_to_first_token(self) -> float:
        return self.first_token_at - self.submitted_at


@dataclass(frozen=True)
class StepResult:
    """What one step did: its batch ts, tokens computed, requests finished, batches sent."""

    ts: float
    tokens: int
    finished: list[str]
    batches: list[KVEventBatch]
