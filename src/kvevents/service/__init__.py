"""The index service: an index fed by a subscriber, a router on it, and its HTTP API.

:class:`IndexService` needs only the core install; the HTTP parts (``create_app``, ``Server``,
``serve`` and their options) need the ``service`` extra and load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports
from kvevents.service.core import IndexService, ServiceStats, WorkerRegistration

if TYPE_CHECKING:
    from kvevents.service.http import (
        AppOptions,
        EndpointPolicy,
        HttpLimits,
        Server,
        TokenCheck,
        create_app,
        serve,
    )

__all__ = [
    "AppOptions",
    "EndpointPolicy",
    "HttpLimits",
    "IndexService",
    "Server",
    "ServiceStats",
    "TokenCheck",
    "WorkerRegistration",
    "create_app",
    "serve",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.service.http": (
            "AppOptions",
            "EndpointPolicy",
            "HttpLimits",
            "Server",
            "TokenCheck",
            "create_app",
            "serve",
        )
    },
)
