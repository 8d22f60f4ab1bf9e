"""A client's request body, read once: what the proxy and the planner need from it.

Only what routing needs is checked here (a JSON object, a string ``model``, a boolean
``stream``, the prompt's field present); everything else is the engine's to judge, and its
400 comes back to the client unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvevents.route._replies import OpenAIError
from kvevents.route._seam import RouteRequest

__all__ = ["PROMPT_FIELDS", "model_of", "route_request"]

#: The planned routes and the field holding each one's prompt.
PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


def _document(body: bytes) -> dict[str, Any]:
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's bound on nesting (about 1,000 levels)
        raise OpenAIError(400, "the request body is nested too deeply") from None
    if not isinstance(document, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    return document


def route_request(path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> RouteRequest:
    """The :class:`RouteRequest` of a planned route's body, or a 400 naming the field."""
    document = _document(body)
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, "`model` must be a string", param="model")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError(400, "`stream` must be a boolean", param="stream")
    field = PROMPT_FIELDS[path]
    if field not in document:
        raise OpenAIError(400, f"`{field}` is required", param=field)
    if field == "messages" and not isinstance(document[field], list):
        raise OpenAIError(400, "`messages` must be a list", param="messages")
    return RouteRequest(path, body, document, model, bool(stream), headers)


def model_of(body: bytes) -> str | None:
    """The ``model`` of a passed-through request's JSON body, if it names one (a body that
    is not JSON, or names none, goes to any healthy engine)."""
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        model = msgspec.json.decode(body).get("model")
    except (msgspec.DecodeError, RecursionError):
        return None
    return model if isinstance(model, str) else None
