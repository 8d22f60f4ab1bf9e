"""``GET /digest``: the digest of a service's index (:mod:`kvevents.index.digest`), so that
operators and tests can see that router replicas agree.

The answer is ``{"total": HEX, "streams": [{worker_id, rank, block_size, blocks, digest}]}``
plus, for a replica, ``covered_seq``: the stream sequence the index holds. Two replicas at the
same ``covered_seq`` must show the same ``total``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvevents.scaleout.digest import service_digest
from kvevents.service.core import IndexService

__all__ = ["digest_route"]


def digest_route(service: IndexService, extra: Callable[[], dict[str, Any]] | None = None) -> Route:
    """The route; ``extra()`` adds keys to the answer (a replica's ``covered_seq``)."""

    def compute() -> dict[str, Any]:
        # The stream's position is read before the digest: a replica applying meanwhile
        # shows a covered_seq at most as new as the blocks digested.
        more = extra() if extra is not None else {}
        return {**service_digest(service).to_dict(), **more}

    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(compute))

    return Route("/digest", endpoint, methods=["GET"])
