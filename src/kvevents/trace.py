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

import hashlib
import sys
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from .errors import TraceError

__all__ = ["TRACE_BLOCK_SIZE", "TraceRow", "block_tokens", "iter_trace", "load_trace", "row_tokens"]

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


def iter_trace(path: str | Path, *, block_size: int = TRACE_BLOCK_SIZE) -> Iterator[TraceRow]:
    """Rows of the JSON-lines trace at ``path``, checked; blank lines are skipped."""
    with open(path, "rb") as lines:
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
    rows: Iterable[TraceRow] = iter_trace(path, block_size=block_size)
    out: list[TraceRow] = []
    for row in rows:
        if limit is not None and len(out) >= limit:
            break
        out.append(row)
    return out
