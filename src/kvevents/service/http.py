"""The HTTP index service behind ``kvevents serve``, one module per job:

- :mod:`kvevents.service.app`: the ASGI routes, authentication and JSON errors;
- :mod:`kvevents.service.query`: the raw ``POST /query`` fast path and its body parse;
- :mod:`kvevents.service.collector`: the Prometheus collector;
- :mod:`kvevents.service.server`: the server thread and its client limits;
- :mod:`kvevents.service.schema`, :mod:`.access`, :mod:`.limits`, :mod:`.dump`: request
  bodies, who may do what, what a client may cost, the streamed dump.

The service itself is :mod:`kvevents.service.core` (and :mod:`.feed`, what feeds it).

This module is the face that gathers them.
"""

from __future__ import annotations

from kvevents.service.access import EndpointPolicy, TokenCheck
from kvevents.service.app import AppOptions, create_app
from kvevents.service.limits import HttpLimits
from kvevents.service.server import Server, serve

__all__ = [
    "AppOptions",
    "EndpointPolicy",
    "HttpLimits",
    "Server",
    "TokenCheck",
    "create_app",
    "serve",
]
