"""The seam between the proxy and routing: a request in, a plan out, its outcome reported.

The proxy never reads the index. For each ``POST /v1/chat/completions`` and
``/v1/completions`` it builds a :class:`RouteRequest` and asks a :class:`Planner` for a
:class:`Plan`: the engines to try, best first. It then tells the planner when it sends the
request to an engine (:meth:`Planner.started`) and how that attempt ended
(:meth:`Planner.finished`, with an :class:`Outcome`): once per attempt, in pairs, so a
planner that charges load at ``started`` releases exactly what it charged. Both are called
on the server's event loop and must not block it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from kvevents._types import Document, DocumentView

if TYPE_CHECKING:
    from kvevents.route._engines import Engine

__all__ = ["Outcome", "OutcomeKind", "Plan", "Planner", "RouteRequest"]


@dataclass(frozen=True)
class RouteRequest:
    """One planned request as the client sent it.

    ``path``: ``"/v1/chat/completions"`` or ``"/v1/completions"``; ``body``: the client's
    bytes, forwarded unchanged; ``json``: the same, parsed once; ``model``: its ``model``
    field (None when absent); ``stream``: its ``stream`` field; ``headers``: the request
    headers as received (lower-case names).
    """

    path: str
    body: bytes
    json: DocumentView
    model: str | None
    stream: bool
    headers: Sequence[tuple[bytes, bytes]]


@dataclass
class Plan:
    """Where to send a request.

    ``candidates``: engines best first; the proxy tries them in order on a retryable
    failure, then any other healthy engine serving the model. ``predicted_cached_tokens``:
    engine id -> prompt tokens the planner expects that engine to have cached (the
    ``x-kvevents-predicted-cached-tokens`` header; a planner may revise an engine's in
    :meth:`Planner.started`, before the proxy reads it). ``explain``: the decision, JSON-ready.
    ``error``: (status, OpenAI error body) to answer instead, e.g. 404 for an unknown model.
    ``headers``: more response headers for the client (the decision explained), added to
    whichever engine's answer it gets. A planner may leave ``explain`` and ``headers`` to
    :meth:`Planner.started`, which the proxy calls once a request is on its way and before it
    reads them: explaining then overlaps the engine's work instead of delaying the request.
    ``context``: the planner's own record of the request
    (the proxy hands the plan back in every call and never reads it). ``prompt_tokens``: the
    prompt's length in tokens as the engine will count it (None: not known), the usage a
    stream continued on another engine reports; ``count_tokens``: counts a text's tokens
    with the model's tokenizer (None: no tokenizer), for the part of an answer a continued
    stream already has.
    """

    candidates: Sequence[Engine]
    predicted_cached_tokens: Mapping[str, int]
    explain: DocumentView
    error: tuple[int, Document] | None = None
    headers: Sequence[tuple[bytes, bytes]] = ()
    context: object = None
    prompt_tokens: int | None = None
    count_tokens: Callable[[str], int] | None = None


#: How one attempt on one engine ended: answered (``ok``, whatever its status below 500),
#: a 5xx (``http_error``), no connection (``connect_error``), no answer in time
#: (``timeout``), the connection lost mid-answer or before it (``reset``), or the client gone.
OutcomeKind = Literal["ok", "http_error", "connect_error", "timeout", "reset", "client_gone"]


@dataclass(frozen=True)
class Outcome:
    """What one attempt got.

    ``status``: the engine's HTTP status (None: no response); ``prompt_tokens`` and
    ``cached_tokens``: from the answer's ``usage`` (``usage.prompt_tokens_details.
    cached_tokens``), when it carried them; ``first_byte_s``: seconds from the request's
    arrival to the engine's first body byte (None: none came); ``total_s``: seconds from the
    request's arrival to the attempt's end; ``completion_tokens``: the answer's tokens, from its
    ``usage`` (None: it did not say).
    """

    status: int | None
    kind: OutcomeKind
    prompt_tokens: int | None
    cached_tokens: int | None
    first_byte_s: float | None
    total_s: float
    completion_tokens: int | None = None


class Planner(Protocol):
    """What the proxy asks for each planned request (see the module docstring)."""

    async def plan(self, request: RouteRequest) -> Plan: ...

    def started(self, plan: Plan, engine: Engine) -> None: ...

    def answering(self, plan: Plan, engine: Engine) -> None: ...

    def finished(self, plan: Plan, engine: Engine, outcome: Outcome) -> None: ...
