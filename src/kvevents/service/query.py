"""``POST /query``, the hot route: its body parse and an ASGI layer that answers it directly.

Starlette's routing and its Request and Response objects cost about as much as the query
itself, so :class:`LeanQuery` answers ``POST /query`` before them. :class:`QueryReader` reads
the body: with the native block table, ``token_ids`` are packed to uint32 straight from the
JSON text in one pass; otherwise they are decoded as a list with the rest of the body.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any, Protocol, cast

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from kvevents.index import table
from kvevents.index.keys import pack_tokens
from kvevents.service.core import IndexService
from kvevents.service.limits import HttpLimits, read_body
from kvevents.service.schema import (
    BadRequest,
    QueryBody,
    QueryPackedBody,
    check_hashes,
    decode,
    mm_spans,
)

__all__ = [
    "JsonPacker",
    "LeanQuery",
    "MemberPacker",
    "QueryReader",
    "Reader",
    "json_response",
]

#: Reads a JSON array of token ids into packed uint32 little-endian bytes; None if it is not one.
JsonPacker = Callable[[bytes], "bytes | None"]
#: Finds a top-level member of a JSON object and packs it: (packed, start, end) or None.
MemberPacker = Callable[[bytes, bytes], "tuple[bytes, int, int] | None"]

_query_decoder = msgspec.json.Decoder(QueryBody)
_query_packed_decoder = msgspec.json.Decoder(QueryPackedBody)
_encoder = msgspec.json.Encoder()
_NULL = b"null"
_TOKEN_MAX = 2**32 - 1
_WHERE = "/query"
_UNREAD = (408, 413)  # refusals that leave the body unread: the connection is spent


def json_packers() -> tuple[JsonPacker | None, MemberPacker | None]:
    """The block table's JSON packers when it is native code, else (None, None).

    The pure-Python packer decodes the array into ints anyway, and doing that together with
    the rest of the body is cheaper than a second pass over it.
    """
    if table.IMPLEMENTATION == "python":
        return None, None
    return table.pack_json_tokens, table.pack_json_member


class Reader(Protocol):
    """What :class:`LeanQuery` needs: a body in, a JSON-ready answer (or a BadRequest) out."""

    def answer(self, body: bytes) -> Any: ...


class QueryReader:
    """Turns a ``POST /query`` body into the service's answer, or a BadRequest saying why."""

    def __init__(
        self,
        service: IndexService,
        packers: tuple[JsonPacker | None, MemberPacker | None] | None = None,
    ) -> None:
        self.service = service
        self.pack_json, self.pack_member = packers if packers is not None else json_packers()

    def answer(self, body: bytes) -> dict[str, Any]:
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


async def json_response(send: Send, status: int, payload: bytes, close: bool = False) -> None:
    """Send one complete JSON response (``close``: and end the connection after it)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class LeanQuery:
    """ASGI layer answering ``POST /query`` itself; everything else goes on to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        reader: Reader,
        limits: HttpLimits,
        count: Callable[[int], None] = lambda status: None,
        observe: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.app = app
        self.reader = reader
        self.limits = limits
        self.count = count  # of each refusal, by status
        self.observe = observe  # seconds each answered query took, body read to answer encoded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/query" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.limits)
            if body is None:
                return  # the client went away
            began = perf_counter()
            status, payload = 200, _encoder.encode(self.reader.answer(body))
            self.observe(perf_counter() - began)
        except BadRequest as exc:
            self.count(exc.status)
            error = _encoder.encode({"error": str(exc)})
            # 408 and 413 leave a body unread on the connection: it cannot be reused.
            await json_response(send, exc.status, error, close=exc.status in _UNREAD)
            return
        await json_response(send, status, payload)
