"""A refused request: its status, its message, and whether it leaves the connection spent.

Every refusal is JSON ``{"error": MESSAGE, ...}`` with a 4xx status; the message names what is
wrong and where (``/query: token id -5 at `$.token_ids[2]` is outside 0..4294967295``).
"""

from __future__ import annotations

from kvevents.http._json import Json

__all__ = ["CLOSES_CONNECTION", "BadRequest", "Refused"]

#: Refusals that leave the request's body unread on the connection (408: it did not arrive in
#: time; 413: it is over the limit): the connection cannot carry another request, so the
#: answer says ``connection: close`` and the connection ends after it.
CLOSES_CONNECTION = frozenset({408, 413})


class BadRequest(Exception):
    """A client's request is wrong; the message names the field and the rule (a 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def payload(self) -> dict[str, Json]:
        """The JSON object answering it."""
        return {"error": str(self)}


class Refused(BadRequest):
    """A refused request with more JSON members than ``error`` (``field``, ``endpoint``...)."""

    def __init__(self, status: int, message: str, **details: Json) -> None:
        super().__init__(message, status)
        self.details = details

    def payload(self) -> dict[str, Json]:
        return {"error": str(self), **self.details}
