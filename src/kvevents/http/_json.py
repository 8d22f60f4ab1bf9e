"""JSON in and out of the HTTP layer: the one writer of a raw JSON response, and the type of a
JSON value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias

import msgspec
from starlette.responses import Response
from starlette.types import Send

__all__ = ["Json", "JsonObject", "encode", "json_response", "send_json"]

#: A value msgspec encodes as JSON: a JSON document may hold a value of any type at any member,
#: and msgspec checks what it is given when it encodes it.
Json: TypeAlias = Any
JsonObject: TypeAlias = dict[str, Json]

encode = msgspec.json.Encoder().encode


def json_response(value: Json, status: int = 200) -> Response:
    """A route's JSON answer."""
    return Response(encode(value), status, media_type="application/json")


async def send_json(
    send: Send,
    status: int,
    payload: bytes,
    *,
    close: bool = False,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send one complete JSON response below the routes (``close``: and end the connection
    after it; ``headers``: more headers)."""
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
        *headers,
    ]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})
