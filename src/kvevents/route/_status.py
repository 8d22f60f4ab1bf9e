"""The front door's status page: ``GET /`` and ``GET /status`` (the JSON it polls).

The page (``page.html``: inline CSS and script, nothing fetched from elsewhere) renders
``/status`` with DOM text nodes only, so an engine's model names or an error text are shown
as text, never parsed as markup; its Content-Security-Policy allows exactly its own inline
script (by hash) and requests to this origin. ``/status``: the engines and their health, each
target's event stream (state, lag, why it gets no cache credit), the planner's counts and its
recent decisions with what the engines then reported.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources
from typing import TYPE_CHECKING

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from kvevents._types import Document
from kvevents.route._replies import OpenAIError, send_json

if TYPE_CHECKING:
    from kvevents.route._frontdoor import FrontDoor

__all__ = ["status", "status_pages"]

_encoder = msgspec.json.Encoder()


def _page() -> tuple[bytes, bytes]:
    """The page's bytes and its Content-Security-Policy (its one script, by hash)."""
    page = resources.files("kvevents.route").joinpath("page.html").read_bytes()
    match = re.search(rb"<script>(.*?)</script>", page, re.S)
    assert match is not None, "page.html has its script inline"
    digest = base64.b64encode(hashlib.sha256(match.group(1)).digest())
    policy = (
        b"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-"
        + digest
        + b"'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'"
    )
    return page, policy


def status(door: FrontDoor) -> Document:
    """What ``GET /status`` answers."""
    engines = [engine.view() for engine in door.pool.engines]
    up = sum(1 for engine in door.pool.engines if engine.up)
    details = door.health_details()
    state = "ok" if up == len(engines) else "degraded" if up else "unavailable"
    stats = door.planner.stats()
    return {
        "status": details.get("status", state),
        "engines": engines,
        "streams": details["streams"],
        "planner": msgspec.to_builtins(stats),
        "decisions": door.planner.decisions(),
    }


def status_pages(door: FrontDoor) -> ASGIApp:
    """An ASGI app answering ``GET /`` and ``GET /status`` (404 for any other path)."""
    page, policy = _page()
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-security-policy", policy),
        (b"x-content-type-options", b"nosniff"),
        (b"cache-control", b"no-store"),
    ]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/":
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": page})
        elif method == "GET" and path == "/status":
            await send_json(send, 200, _encoder.encode(status(door)))
        else:
            error = OpenAIError(404, f"no such endpoint: {method} {path}")
            await send_json(send, 404, error.payload)

    return app
