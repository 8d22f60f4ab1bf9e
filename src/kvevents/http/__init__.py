"""The HTTP layer: the index service's API over HTTP (``kvevents serve``) and the pieces any
HTTP server of the package is built from. Needs the ``service`` extra.

Above the domain it serves (:mod:`kvevents.service`), below ``cli``. Its face:

- the app and its server: :func:`create_app`, :class:`AppOptions`, :func:`serve`,
  :class:`Server` (uvicorn on a socket bound first, each connection a
  :class:`LimitedProtocol`: client limits, pipelining within bounds, ``POST /query`` answered
  on the connection);
- what a client may cost and who may do what: :class:`HttpLimits` and :func:`read_body`,
  :class:`HttpCounters` (:class:`HttpStats`), :class:`TokenCheck`, :class:`EndpointPolicy`;
- JSON answers and refusals: :class:`BadRequest`, :class:`Refused`, :func:`json_response`,
  :func:`send_json`;
- ``POST /query``'s one handler: :class:`QueryHandler` over a :class:`QueryReader`;
- the other pieces of a server: :func:`metrics_registry`, :func:`metrics_route` and
  :func:`query_histogram` (``GET /metrics``), :func:`status_routes` and :class:`Status` (the
  status page), :func:`digest_route` (``GET /digest``).

Its modules are private (``_app``, ``_protocol``...): import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.http._access import (
        DEFAULT_ALLOWED_HOSTS,
        EndpointPolicy,
        TokenCheck,
        exposed_mode,
        is_loopback,
        load_token,
    )
    from kvevents.http._app import Api, AppOptions, create_app
    from kvevents.http._digest import digest_route
    from kvevents.http._errors import BadRequest, Refused
    from kvevents.http._json import json_response, send_json
    from kvevents.http._limits import HttpCounters, HttpLimits, HttpStats, read_body
    from kvevents.http._metrics import metrics_registry, metrics_route, query_histogram
    from kvevents.http._protocol import ABORT, LimitedProtocol
    from kvevents.http._query import QueryHandler, QueryReader
    from kvevents.http._server import Server, serve
    from kvevents.http._status import Status, status_routes

__all__ = [
    "ABORT",
    "DEFAULT_ALLOWED_HOSTS",
    "Api",
    "AppOptions",
    "BadRequest",
    "EndpointPolicy",
    "HttpCounters",
    "HttpLimits",
    "HttpStats",
    "LimitedProtocol",
    "QueryHandler",
    "QueryReader",
    "Refused",
    "Server",
    "Status",
    "TokenCheck",
    "create_app",
    "digest_route",
    "exposed_mode",
    "is_loopback",
    "json_response",
    "load_token",
    "metrics_registry",
    "metrics_route",
    "query_histogram",
    "read_body",
    "send_json",
    "serve",
    "status_routes",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.http._access": (
            "DEFAULT_ALLOWED_HOSTS",
            "EndpointPolicy",
            "TokenCheck",
            "exposed_mode",
            "is_loopback",
            "load_token",
        ),
        "kvevents.http._app": ("Api", "AppOptions", "create_app"),
        "kvevents.http._digest": ("digest_route",),
        "kvevents.http._errors": ("BadRequest", "Refused"),
        "kvevents.http._json": ("json_response", "send_json"),
        "kvevents.http._limits": ("HttpCounters", "HttpLimits", "HttpStats", "read_body"),
        "kvevents.http._metrics": ("metrics_registry", "metrics_route", "query_histogram"),
        "kvevents.http._protocol": ("ABORT", "LimitedProtocol"),
        "kvevents.http._query": ("QueryHandler", "QueryReader"),
        "kvevents.http._server": ("Server", "serve"),
        "kvevents.http._status": ("Status", "status_routes"),
    },
)
