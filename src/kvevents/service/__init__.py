"""The index service: an index fed by a subscriber, a router on it, under one lock.

:class:`IndexService` needs only the core install. Its HTTP API (``create_app``, ``Server``,
``serve`` and their options) is the layer above, :mod:`kvevents.http` (the ``service`` extra).
"""

from __future__ import annotations

from kvevents.service.core import IndexService, ServiceStats, WorkerRegistration

__all__ = ["IndexService", "ServiceStats", "WorkerRegistration"]
