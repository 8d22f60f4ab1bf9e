"""HTTP/1.1 on the connection, as bytes: what the protocol reads from a request's head, and the
responses it writes itself (``POST /query`` answers and refusals, without the app).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.http._uvicorn import STATUS_LINE

__all__ = ["HEADERS_TOO_LARGE", "declared_length", "head_without_upgrade", "json_response_bytes"]

Headers = list[tuple[bytes, bytes]]

_TOO_LARGE_BODY = b'{"error": "request headers are over the limit"}'
#: The 431 of a request whose line and headers are over the limit (the connection then closes).
HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)
# The tokens of an offer to switch protocols, in a Connection header.
_UPGRADE_TOKENS = frozenset({b"upgrade", b"http2-settings"})


def declared_length(headers: Headers) -> int | None:
    """The request's ``content-length``, None without one."""
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # httptools has refused a content-length that is not a number
    return None


def head_without_upgrade(method: bytes, url: bytes, version: str, headers: Headers) -> bytes:
    """A request's line and headers again, without its offer to switch protocols: no
    ``Upgrade`` header, and no ``upgrade`` or ``http2-settings`` token in ``Connection``."""
    head = [method, b" ", url, b" HTTP/", version.encode(), b"\r\n"]
    for name, value in _without_upgrade(headers):
        head += [name, b": ", value, b"\r\n"]
    head.append(b"\r\n")
    return b"".join(head)


def _without_upgrade(headers: Headers) -> Headers:
    kept = []
    for name, value in headers:
        if name == b"connection":
            tokens = [t.strip() for t in value.split(b",")]
            value = b", ".join(t for t in tokens if t and t.lower() not in _UPGRADE_TOKENS)
            if not value:
                continue
        if name != b"upgrade":
            kept.append((name, value))
    return kept


def json_response_bytes(
    status: int, payload: bytes, default_headers: Iterable[tuple[bytes, bytes]], *, close: bool
) -> bytes:
    """One complete JSON response: the status line, the server's ``default_headers`` (its
    ``server`` and ``date``, as uvicorn writes them), the content headers, the payload."""
    head = [STATUS_LINE[status]]
    for name, value in default_headers:
        head += [name, b": ", value, b"\r\n"]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(payload))
    if close:
        head.append(b"connection: close\r\n")
    head += [b"\r\n", payload]
    return b"".join(head)
