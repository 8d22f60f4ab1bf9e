"""``GET /digest``: the digest of a service's index (:mod:`kvevents.index.digest`), so that
operators and tests can see that router replicas agree.

The answer is ``{"total": HEX, "streams": [{worker_id, rank, block_size, blocks, digest}]}``
plus what ``extra`` adds: for a replica, ``covered_seq``, the stream sequence the index holds.
Two replicas at the same ``covered_seq`` must show the same ``total``.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvevents.http._json import JsonObject, json_response
from kvevents.index.digest import holders_digest
from kvevents.service.core import IndexService

__all__ = ["DigestExtra", "digest_route"]

#: More members of the answer, read just before the digest is computed.
DigestExtra = Callable[[], JsonObject]


def digest_route(service: IndexService, extra: DigestExtra | None = None) -> Route:
    """The route; ``extra()`` adds members to the answer (a replica's ``covered_seq``)."""

    def compute() -> JsonObject:
        # The stream's position is read before the digest: a replica applying meanwhile
        # shows a covered_seq at most as new as the blocks digested. The service's lock is
        # held for one holder's copy at a time (a digest of 1M blocks takes about a second).
        more = extra() if extra is not None else {}
        return {**holders_digest(service.holders(), service.holder_blocks).to_dict(), **more}

    async def endpoint(request: Request) -> Response:
        return json_response(await run_in_threadpool(compute))

    return Route("/digest", endpoint, methods=["GET"])
