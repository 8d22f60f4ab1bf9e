"""Every uvicorn internal the HTTP layer leans on, imported here and nowhere else.

:class:`~kvevents.http.LimitedProtocol` subclasses uvicorn's httptools protocol,
which is not a public API of uvicorn. It does so because answering ``POST /query`` on the
connection, without an ASGI task, costs about 40% less server CPU a query than uvicorn's
public (ASGI) path (docs/native.md, "/query on the connection"). What it relies on:

- ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol``: its parser callbacks
  (``on_message_begin``, ``on_url`` and ``on_header`` filling ``url`` and ``headers``,
  ``on_headers_complete``, ``on_body``, ``on_message_complete``), ``on_response_complete``,
  ``connection_made``/``connection_lost``, ``pause_writing``/``resume_writing``,
  ``handle_websocket_upgrade``, ``send_400_response``, ``_should_upgrade``,
  ``_unset_keepalive_if_required``, ``timeout_keep_alive_handler``, and the attributes
  ``parser``, ``url``, ``headers``, ``expect_100_continue``, ``cycle``, ``pipeline``,
  ``flow``, ``transport``, ``loop``, ``logger``, ``connections``, ``server_state``,
  ``timeout_keep_alive`` and ``timeout_keep_alive_task``; ``RequestResponseCycle`` (its
  ``response_complete``, ``response_started``, ``chunked_encoding`` (True once the head of
  a chunked body is out), ``disconnected``, ``scope`` and ``transport``, to which its
  ``send`` writes the head on ``http.response.start`` and each body message in one write
  (a chunked body's message as one chunk), and nothing for a HEAD request's body) and
  ``STATUS_LINE``;
- ``uvicorn.protocols.http.flow_control.FlowControl``: ``read_paused``, ``write_paused``,
  ``pause_reading`` and ``resume_reading``.

Hence uvicorn is pinned to the versions tested (``pyproject.toml``), and :data:`TESTED` maps
the digest of those two modules' source (:func:`source_digest`) to the versions that have it.
``tests/http/test_http_uvicorn.py`` fails on a uvicorn outside the range or whose modules differ
from every version tested. To take a new uvicorn: run the HTTP tests against it
(``tests/http/test_http_protocol.py``, ``tests/http/test_hostile_http.py``, ``tests/http/test_service.py``),
then add its digest here and widen the range.
"""

from __future__ import annotations

import hashlib
import importlib.util

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

__all__ = [
    "SOURCES",
    "STATUS_LINE",
    "TESTED",
    "TESTED_RANGE",
    "FlowControl",
    "HttpToolsProtocol",
    "RequestResponseCycle",
    "source_digest",
]

#: The modules whose source the protocol depends on.
SOURCES = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.flow_control")
#: The uvicorn versions ``pyproject.toml`` allows: ``>=`` the first, ``<`` the second.
TESTED_RANGE = ("0.50", "0.55")
#: :func:`source_digest` of each uvicorn the HTTP tests passed on, and the versions sharing it
#: (the tests ran on the newest of each; the others have the same source).
TESTED = {
    "239439c9f764a00415814527d3c313c9cfb8365f2e4d54d02ab2302b09b74593": (
        "0.50.0 0.50.1 0.50.2 0.51.0 0.52.0 0.52.1 0.52.2 0.52.3 0.52.4"
    ),
    "472ace5dc107b57894129c0bae3c7b77c9a81a24ba746b1df51b5b2b531c3022": "0.53.0 0.54.0",
}


def source_digest() -> str:
    """The sha256 of the installed uvicorn's :data:`SOURCES`, each named and in order."""
    digest = hashlib.sha256()
    for name in SOURCES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ImportError(f"{name} has no source file")
        with open(spec.origin, "rb") as source:
            digest.update(name.encode() + b"\0" + source.read() + b"\0")
    return digest.hexdigest()
