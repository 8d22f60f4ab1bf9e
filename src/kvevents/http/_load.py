"""``POST /load``: engines' load reports, for the router's load-aware choices.

Body ``{"loads": [{worker_id | instance_id, rank? | dp_rank?, queued_blocks, active_blocks},
...]}``: each (worker, rank)'s prefill blocks queued and KV blocks held by running requests,
as :class:`~kvevents.index.decision.Load` counts them. A report replaces the target's load and
counts for the service's load TTL (:mod:`kvevents.service.loadreports`). Entries for workers
or ranks not registered are not applied: the reply lists them (``unknown``), and
``kvevents_service_load_unknown`` counts them. It is a mutating endpoint: behind the token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvevents.http._errors import BadRequest
from kvevents.http._json import json_response
from kvevents.http._schema import LoadBody, LoadEntry, decode
from kvevents.service.core import IndexService
from kvevents.service.loadreports import LoadReport

__all__ = ["load_endpoint", "load_reports"]

_WHERE = "/load"
_decoder = msgspec.json.Decoder(LoadBody)

Endpoint = Callable[[Request], Awaitable[Response]]


def load_reports(body: bytes) -> list[LoadReport]:
    """The reports a ``POST /load`` body carries; BadRequest naming the field otherwise."""
    return [_report(i, entry) for i, entry in enumerate(decode(body, _decoder, _WHERE).loads)]


def _report(i: int, entry: LoadEntry) -> LoadReport:
    worker = entry.worker_id if entry.worker_id is not None else entry.instance_id
    if worker is None:
        raise BadRequest(f"{_WHERE}: worker_id (or instance_id) is required - at `$.loads[{i}]`")
    rank = entry.rank if entry.rank is not None else entry.dp_rank
    return LoadReport(str(worker), rank or 0, entry.queued_blocks, entry.active_blocks)


def load_endpoint(service: IndexService, read: Callable[[Request], Awaitable[bytes]]) -> Endpoint:
    """The ``POST /load`` handler over ``service``; ``read`` reads a body within the limits."""

    async def post_load(request: Request) -> Response:
        reports = load_reports(await read(request))
        # Under the index lock, like a query, but brief: a dict update per entry.
        unknown = service.report_loads(reports)
        reply = {
            "applied": len(reports) - len(unknown),
            "unknown": [{"worker_id": w, "rank": r} for w, r in unknown],
        }
        return json_response(reply)

    return post_load
