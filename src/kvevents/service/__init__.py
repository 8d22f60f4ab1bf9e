"""The index service: an index fed by a subscriber, a router on it, and its HTTP API.

:class:`IndexService` needs only the core install; the HTTP parts (``create_app``, ``Server``,
``serve``) need the ``service`` extra and load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports
from kvevents.service.core import IndexService, ServiceStats, WorkerRegistration

if TYPE_CHECKING:
    from kvevents.service.http import Server, create_app, serve

__all__ = ["IndexService", "Server", "ServiceStats", "WorkerRegistration", "create_app", "serve"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"kvevents.service.http": ("Server", "create_app", "serve")}
)
