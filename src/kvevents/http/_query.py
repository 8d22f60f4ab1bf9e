"""``POST /query``, the hot route: its one handler and its body parse.

:class:`QueryHandler` answers a whole body with (status, JSON payload): the connection's
protocol calls it for the queries it answers itself (:mod:`kvevents.http._protocol`), the
app's ``/query`` route for those it leaves to the app (HTTP/1.0, ``Expect: 100-continue``...).
:class:`QueryReader` reads the body: with the native JSON scanner (:mod:`kvevents.http._scan`),
``token_ids`` are packed to uint32 straight from the JSON text in one pass; otherwise they are
decoded as a list with the rest of the body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Protocol, cast

import msgspec

from kvevents.http import _scan
from kvevents.http._access import TokenCheck
from kvevents.http._errors import BadRequest
from kvevents.http._json import Json, JsonObject, encode
from kvevents.http._limits import HttpCounters
from kvevents.http._schema import (
    QueryBody,
    QueryPackedBody,
    check_hashes,
    decode,
    mm_spans,
)
from kvevents.index.keys import pack_tokens
from kvevents.service.core import IndexService

__all__ = ["JsonPacker", "MemberPacker", "QueryHandler", "QueryReader", "Reader", "json_packers"]

log = logging.getLogger("kvevents.http.query")

#: Reads a JSON array of token ids into packed uint32 little-endian bytes; None if it is not one.
JsonPacker = Callable[[bytes], "bytes | None"]
#: Finds a top-level member of a JSON object and packs it: (packed, start, end) or None.
MemberPacker = Callable[[bytes, bytes], "tuple[bytes, int, int] | None"]

_query_decoder = msgspec.json.Decoder(QueryBody)
_query_packed_decoder = msgspec.json.Decoder(QueryPackedBody)
_NULL = b"null"
_TOKEN_MAX = 2**32 - 1
_WHERE = "/query"


def json_packers() -> tuple[JsonPacker | None, MemberPacker | None]:
    """The native JSON scanner's packers, else (None, None).

    The pure-Python scanner decodes the array into ints anyway, and doing that together with
    the rest of the body is cheaper than a second pass over it.
    """
    if _scan.IMPLEMENTATION == "python":
        return None, None
    return _scan.pack_json_tokens, _scan.pack_json_member


class Reader(Protocol):
    """What :class:`QueryHandler` needs: a body in, a JSON-ready answer (or a BadRequest) out."""

    def answer(self, body: bytes) -> Json: ...


class QueryHandler:
    """``POST /query``: a whole body in, (status, JSON payload) out, on every path a query
    reaches. Each refusal is counted by its status; each answer's time, from its body read to
    its answer encoded, goes to ``observe`` (the ``kvevents_query_duration_seconds`` histogram).

    ``auth``: who may query (:meth:`admits`: a request the protocol may answer itself; one it
    may not goes on to the app, whose guard refuses it).
    """

    def __init__(
        self,
        reader: Reader,
        auth: TokenCheck,
        counters: HttpCounters,
        observe: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.reader = reader
        self.auth = auth
        self.counters = counters
        self.observe = observe

    def admits(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether a query with ``headers`` needs no token or carries it."""
        return self.auth.allows(headers, mutating=False)

    def respond(self, body: bytes) -> tuple[int, bytes]:
        """(status, JSON payload) for a whole ``POST /query`` body."""
        try:
            began = perf_counter()
            payload = encode(self.reader.answer(body))
            self.observe(perf_counter() - began)
            return 200, payload
        except BadRequest as exc:
            self.counters.refused(exc.status)
            return exc.status, encode(exc.payload())
        except Exception as exc:
            log.exception("POST /query failed")
            return 500, encode({"error": f"internal error: {type(exc).__name__}"})


class QueryReader:
    """Turns a ``POST /query`` body into the service's answer, or a BadRequest saying why."""

    def __init__(
        self,
        service: IndexService,
        packers: tuple[JsonPacker | None, MemberPacker | None] | None = None,
    ) -> None:
        self.service = service
        self.pack_json, self.pack_member = packers if packers is not None else json_packers()

    def answer(self, body: bytes) -> JsonObject:
        """The answer to a ``POST /query`` body."""
        query, packed = self.read(body)
        check_hashes(query.block_hashes)
        # Tokens come packed, unless digest tokens are among them (the index's slow path:
        # read() then hands the decoded list over; otherwise token_ids may be raw JSON).
        tokens = query.token_ids if packed is None and isinstance(query.token_ids, list) else None
        mm = mm_spans(query)
        lora = query.lora_name if query.lora_name is not None else query.lora_id
        try:
            return self.service.query(
                tokens,
                packed=packed,
                block_hashes=query.block_hashes,
                block_size=query.block_size,
                lora=lora,
                cache_salt=query.cache_salt,
                mm=mm,
                policy=query.policy,
                prefill_weight=query.prefill_weight,
                load_weight=query.load_weight,
                model_name=query.model_name,
            )
        except (ValueError, OverflowError) as exc:
            raise BadRequest(f"{_WHERE}: {exc}") from None

    def read(self, body: bytes) -> tuple[QueryBody, bytes | None]:
        """The decoded query and its tokens packed as uint32 LE (None without token_ids)."""
        if self.pack_json is None:
            query = decode(body, _query_decoder, _WHERE)
            if query.token_ids is None:
                return query, None
            if _has_digests(query.token_ids):
                _check_range(query.token_ids)
                return query, None
            try:
                return query, pack_tokens(cast("list[int]", query.token_ids))
            except OverflowError:
                raise BadRequest(_token_range_error(query.token_ids)) from None
        if self.pack_member is not None:
            # token_ids found and packed in one pass; the small rest of the body is decoded
            # as usual (a repeated token_ids shows up there: the full path reads it).
            found = self.pack_member(body, b"token_ids")
            if found is not None:
                packed, start, end = found
                rest = decode(body[:start] + _NULL + body[end:], _query_packed_decoder, _WHERE)
                if bytes(rest.token_ids) == _NULL:
                    return rest, packed
        return self._read_raw(body, self.pack_json)

    @staticmethod
    def _read_raw(body: bytes, pack_json: JsonPacker) -> tuple[QueryBody, bytes | None]:
        query = decode(body, _query_packed_decoder, _WHERE)
        raw = query.token_ids
        if not raw or (len(raw) == len(_NULL) and bytes(raw) == _NULL):
            return query, None
        tokens = pack_json(raw)
        if tokens is not None:
            return query, tokens
        # Not all uint32: digest tokens (read token by token), or a range error to name.
        full = decode(body, _query_decoder, _WHERE)
        if full.token_ids is not None and _has_digests(full.token_ids):
            _check_range(full.token_ids)
            return full, None
        raise BadRequest(_token_range_error(full.token_ids or []))


def _has_digests(tokens: list[int | str]) -> bool:
    return any(isinstance(token, str) for token in tokens)


def _check_range(tokens: list[int | str]) -> None:
    """BadRequest naming the first int token outside uint32, if any."""
    for token in tokens:
        if isinstance(token, int) and not 0 <= token <= _TOKEN_MAX:
            raise BadRequest(_token_range_error(tokens))


def _token_range_error(tokens: list[int | str]) -> str:
    for i, token in enumerate(tokens):
        if isinstance(token, int) and not 0 <= token <= _TOKEN_MAX:
            return f"{_WHERE}: token id {token} at `$.token_ids[{i}]` is outside 0..{_TOKEN_MAX}"
    return f"{_WHERE}: token_ids must be an array of token ids"
