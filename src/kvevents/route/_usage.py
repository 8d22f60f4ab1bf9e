"""The ``usage`` an engine reports with each answer, read as the answer passes through.

vLLM run with ``--enable-prompt-tokens-details`` reports the prompt tokens it served from its
cache in ``usage.prompt_tokens_details.cached_tokens``: at the end of a JSON answer, and in
the last event of a stream when the client asked for ``stream_options.include_usage``
(:mod:`kvevents.route._sse` reads those). Nothing here changes or delays a byte: readers see
copies of the pieces the proxy forwards.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

import msgspec

__all__ = ["BodyUsage", "Usage", "usage_of"]

#: Answers up to this size are kept whole (references to the forwarded pieces) and decoded at
#: their end; a larger one only keeps its last ``_TAIL`` bytes, where vLLM puts ``usage``.
_WHOLE = 1 << 20
_TAIL = 64 << 10
_KEY = b'"usage":'


@dataclass(frozen=True)
class Usage:
    """``prompt_tokens``, ``cached_tokens`` and ``completion_tokens`` (None: the answer did
    not say)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Carrier(msgspec.Struct):
    usage: _Usage | None = None


_decoder = msgspec.json.Decoder(_Carrier)


def usage_of(document: bytes) -> Usage | None:
    """The top-level ``usage`` of a JSON object, or None (absent, null, or not JSON)."""
    try:
        found = _decoder.decode(document).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if found is None:
        return None
    details = found.prompt_tokens_details
    cached = None if details is None else details.cached_tokens
    return Usage(found.prompt_tokens, cached, found.completion_tokens)


class BodyUsage:
    """The ``usage`` of a JSON answer fed piece by piece (:meth:`feed`, then :meth:`result`)."""

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._size = 0  # bytes in _pieces
        self._whole = True  # every piece is still held

    def feed(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size > _WHOLE:
            self._whole = False
        if not self._whole:
            while self._size - len(self._pieces[0]) >= _TAIL:
                self._size -= len(self._pieces.popleft())

    def result(self) -> Usage | None:
        body = b"".join(self._pieces)
        return usage_of(body) if self._whole else _usage_in_tail(body)


def _usage_in_tail(tail: bytes) -> Usage | None:
    """The last ``"usage": {...}`` member in the end of a large JSON answer.

    ``"usage":`` cannot occur inside a JSON string (its quotes would be escaped), so the
    last occurrence is a member; its value is decoded on its own.
    """
    at = tail.rfind(_KEY)
    if at < 0:
        return None
    text = tail[at + len(_KEY) :].decode("utf-8", "replace")
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError:
        return None
    return usage_of(json.dumps({"usage": value}).encode())
