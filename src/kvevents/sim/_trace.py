"""Mooncake-style workload traces: rows of hash ids turned into deterministic token ids.

A trace row (one JSON object per line) is ``timestamp`` (ms since the trace start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: one id per 512-token block of
the prompt. Equal ids mean equal blocks, so the tokens of a block are a pure function of its id
(:func:`block_tokens`): two rows that share leading ids share those tokens, and an engine's
own chained hashes then share the same prefix. The last block may be partial:
``input_length`` says how many of its tokens the prompt uses.

Token ids are uniform in ``[0, 65536)``, drawn from SHAKE-128 of the id, so the mapping is the
same on every machine and in every process.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import msgspec

from kvevents.errors import TraceError
from kvevents.sim._engine import SimulatedEngine
from kvevents.sim._records import EngineMetrics, Request, StepResult

__all__ = [
    "BUNDLED_TRACE",
    "TRACE_BLOCK_SIZE",
    "TraceRow",
    "TraceRun",
    "block_tokens",
    "default_trace_path",
    "iter_trace",
    "load_trace",
    "row_tokens",
    "run_trace",
    "trace_request",
]

#: Tokens per hash id in Mooncake traces.
TRACE_BLOCK_SIZE = 512
_DOMAIN = b"kvevents-trace-block"


class TraceRow(msgspec.Struct, frozen=True):
    """One request of a trace. ``timestamp`` is in milliseconds since the trace start."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]

    @property
    def arrival(self) -> float:
        """Arrival time in seconds since the trace start."""
        return self.timestamp / 1000.0


_row_decoder = msgspec.json.Decoder(TraceRow)


def block_tokens(hash_id: int, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """The ``block_size`` token ids that ``hash_id`` stands for (deterministic)."""
    digest = hashlib.shake_128(_DOMAIN + hash_id.to_bytes(8, "big", signed=True))
    tokens = array("H", digest.digest(2 * block_size))
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tolist()


def row_tokens(row: TraceRow, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """The prompt of ``row``: its blocks' tokens, cut to ``input_length``."""
    tokens: list[int] = []
    for hash_id in row.hash_ids:
        tokens.extend(block_tokens(hash_id, block_size))
    del tokens[row.input_length :]
    return tokens


def _check_row(row: TraceRow, block_size: int) -> str | None:
    blocks = len(row.hash_ids)
    if row.input_length <= 0 or row.output_length < 0 or row.timestamp < 0:
        return "input_length must be > 0, output_length and timestamp >= 0"
    if not (blocks - 1) * block_size < row.input_length <= blocks * block_size:
        return (
            f"input_length {row.input_length} does not fit {blocks} hash ids of {block_size} tokens"
        )
    return None


#: The Mooncake synthetic trace shipped in the package (``data/README.md`` says where it comes
#: from and its licence): 3,993 requests, gzip-compressed JSON lines.
BUNDLED_TRACE = "mooncake_synthetic_trace.jsonl.gz"


def default_trace_path() -> str:
    """The trace commands read when none is given: ``KVEVENTS_TRACE``, else the bundled one."""
    override = os.environ.get("KVEVENTS_TRACE")
    if override:
        return override
    return str(resources.files("kvevents.sim") / "data" / BUNDLED_TRACE)


def iter_trace(path: str | Path, *, block_size: int = TRACE_BLOCK_SIZE) -> Iterator[TraceRow]:
    """Rows of the JSON-lines trace at ``path`` (``.gz`` read compressed), checked; blank lines
    are skipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = _row_decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(str(exc), path=str(path), line=number) from exc
            problem = _check_row(row, block_size)
            if problem:
                raise TraceError(problem, path=str(path), line=number)
            yield row


def load_trace(
    path: str | Path, *, limit: int | None = None, block_size: int = TRACE_BLOCK_SIZE
) -> list[TraceRow]:
    """The first ``limit`` rows (all when None) of the trace at ``path``."""
    out: list[TraceRow] = []
    if limit is not None and limit <= 0:
        return out
    for row in iter_trace(path, block_size=block_size):
        out.append(row)
        if len(out) == limit:
            break
    return out


def trace_request(row: TraceRow, index: int, block_size: int = TRACE_BLOCK_SIZE) -> Request:
    """Row ``index`` of a trace as an engine request (id ``trace-<index>``)."""
    return Request(f"trace-{index}", row_tokens(row, block_size), max(1, row.output_length))


@dataclass(frozen=True)
class TraceRun:
    """Summary of :func:`run_trace`: rows submitted, steps run, wall seconds taken."""

    rows: int
    steps: int
    wall_seconds: float
    metrics: EngineMetrics


Router = Callable[[Request, SimulatedEngine], "int | None"]


def run_trace(
    engine: SimulatedEngine,
    rows: Sequence[TraceRow],
    *,
    realtime: bool = False,
    speedup: float = 1.0,
    router: Router | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    max_steps: int | None = None,
) -> TraceRun:
    """Feed ``rows`` to ``engine`` at their arrival times and step until every request ends.

    Virtual time (default): arrivals follow the engine's modeled step durations and idle gaps
    are skipped, so a run is reproducible and as fast as the machine allows. Real time: rows
    arrive at ``timestamp / speedup`` wall seconds and steps are paced to their modeled
    duration divided by ``speedup`` (pair it with ``SimulatedEngine(clock=time.time)``).
    ``router(request, engine)`` picks a rank (None: the engine's least-loaded choice).
    """
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    feeder = _Feeder(engine, rows, router, speedup if realtime else None)
    steps = 0
    while (feeder.pending or engine.has_work()) and (max_steps is None or steps < max_steps):
        if feeder.wait_for_arrival():
            continue
        feeder.submit_arrived()
        began = time.monotonic()
        result = engine.step()
        steps += 1
        if on_step is not None:
            on_step(result)
        feeder.pace(result, began)
    return TraceRun(len(rows), steps, time.monotonic() - feeder.start, engine.metrics())


class _Feeder:
    """Submits trace rows as their arrival time comes, in virtual or (scaled) wall time."""

    def __init__(
        self,
        engine: SimulatedEngine,
        rows: Sequence[TraceRow],
        router: Router | None,
        speedup: float | None,
    ) -> None:
        self.engine = engine
        self.router = router
        self.speedup = speedup
        self.pending = deque(sorted(enumerate(rows), key=lambda item: item[1].timestamp))
        self.start = time.monotonic()

    def now(self) -> float:
        if self.speedup is None:
            return self.engine.now
        return (time.monotonic() - self.start) * self.speedup

    def wait_for_arrival(self) -> bool:
        """When the engine is idle before the next arrival, skip (or sleep) to it."""
        if self.engine.has_work() or not self.pending:
            return False
        gap = self.pending[0][1].arrival - self.now()
        if gap <= 0:
            return False
        if self.speedup is None:
            self.engine.advance_to(self.pending[0][1].arrival)
        else:
            time.sleep(gap / self.speedup)
        return True

    def submit_arrived(self) -> None:
        now = self.now()
        while self.pending and self.pending[0][1].arrival <= now:
            index, row = self.pending.popleft()
            request = trace_request(row, index)
            rank = None if self.router is None else self.router(request, self.engine)
            self.engine.submit(request, rank)

    def pace(self, result: StepResult, began: float) -> None:
        """In real time, a step lasts its modeled duration divided by the speedup."""
        if self.speedup is None:
            return
        cfg = self.engine.config
        modeled = (cfg.step_base_s + cfg.step_token_s * result.tokens) / self.speedup
        time.sleep(max(0.0, modeled - (time.monotonic() - began)))
