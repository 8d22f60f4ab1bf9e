"""The proxy's own answers: JSON bodies, and OpenAI-shaped errors
(``{"error": {"message", "type", "param", "code"}}`` with a status).

Clients of the OpenAI API (its own Python client among them) read ``error.message`` and the
status; vLLM answers in the same shape, so an error from the front door looks like one from
the engine behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.types import Send

__all__ = ["OpenAIError", "error_body", "error_type", "send_json"]

_encoder = msgspec.json.Encoder()


def error_type(status: int) -> str:
    """The OpenAI ``type`` of an error status: the request's fault or the server's."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON object of an error (what :attr:`OpenAIError.body` holds)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class OpenAIError(Exception):
    """A request refused or failed with ``status``; :attr:`payload` is its encoded body.

    ``param``: the request field at fault (``"model"``, ``"messages"``), ``code``: a short
    machine-readable reason (``"model_not_found"``, ``"no_healthy_engine"``).
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, param=param, code=code)

    @property
    def payload(self) -> bytes:
        return _encoder.encode(self.body)


async def send_json(
    send: Send, status: int, payload: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer ``payload`` (encoded JSON) with ``status``, in one body message."""
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})
