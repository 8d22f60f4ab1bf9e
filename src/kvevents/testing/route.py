"""Test doubles for the front door: a stand-in planner, and a proxy in front of stand-in engines.

:class:`RoundRobinPlanner` plans as a router without an index would: the healthy engines
serving the model, in turn, no predicted cache. It records every call the proxy makes
(``plans``, ``started``, ``finished``), so a test can assert what the planner was told.
:func:`running_proxy` starts :class:`kvevents.route.RouteApp` on a server thread in front
of given engine URLs and stops it afterwards (:class:`RunningProxy`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.http import Server
from kvevents.route import (
    Engine,
    EnginePool,
    Outcome,
    Plan,
    Planner,
    ProxyOptions,
    RouteApp,
    RouteRequest,
)

__all__ = ["RoundRobinPlanner", "RunningProxy", "running_proxy"]


class RoundRobinPlanner:
    """The healthy engines serving the request's model, starting one further each time
    (``rotate=False``: always in pool order).

    ``predicted``: engine id -> the predicted cached tokens to report (default none).
    ``plans``, ``sent`` (each ``started``), ``ended`` (each ``finished``): what the proxy
    asked and told, in order.
    """

    def __init__(
        self,
        pool: EnginePool,
        predicted: Mapping[str, int] | None = None,
        *,
        rotate: bool = True,
    ) -> None:
        self.pool = pool
        self.rotate = rotate
        self.predicted = dict(predicted or {})
        self.plans: list[RouteRequest] = []
        self.sent: list[tuple[Plan, Engine]] = []
        self.ended: list[tuple[Plan, Engine, Outcome]] = []
        self._turn = 0
        self._lock = threading.Lock()

    async def plan(self, request: RouteRequest) -> Plan:
        with self._lock:
            self.plans.append(request)
        error = self.pool.unavailable(request.model)
        if error is not None:
            return Plan((), {}, {"reason": str(error)}, error=(error.status, error.body))
        engines = self.pool.healthy(request.model)
        if self.rotate:
            self._turn = (self._turn + 1) % len(engines)
        order = engines[self._turn :] + engines[: self._turn]
        explain = {"policy": "round_robin", "winner": order[0].id}
        return Plan(order, dict(self.predicted), explain)

    def started(self, plan: Plan, engine: Engine) -> None:
        with self._lock:
            self.sent.append((plan, engine))

    def finished(self, plan: Plan, engine: Engine, outcome: Outcome) -> None:
        with self._lock:
            self.ended.append((plan, engine, outcome))

    def outcomes(self) -> list[Outcome]:
        """The outcomes reported so far, oldest first."""
        with self._lock:
            return [outcome for _, _, outcome in self.ended]


@dataclass(frozen=True)
class RunningProxy:
    """A front door started by :func:`running_proxy`: its server, app, pool and planner."""

    server: Server
    app: RouteApp
    pool: EnginePool
    planner: Any

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    def engine(self, url: str) -> Engine:
        """The pool's record of the engine at ``url``."""
        found = self.pool.get(url)
        if found is None:
            raise KeyError(f"no engine {url} in the pool")
        return found


@contextlib.contextmanager
def running_proxy(
    urls: Sequence[str],
    *,
    options: ProxyOptions | None = None,
    interval: float = 0.5,
    timeout: float = 1.0,
    planner: Callable[[EnginePool], Planner] = RoundRobinPlanner,
    **app_options: Any,
) -> Iterator[RunningProxy]:
    """A started front door over ``urls`` (health checks every ``interval`` s, each bounded
    by ``timeout``), its planner made by ``planner(pool)``; stopped on exit."""
    pool = EnginePool(urls, interval=interval, timeout=timeout)
    made = planner(pool)
    app = RouteApp(pool, made, options=options, **app_options)
    server = Server(app, limits=app.options.limits).start()
    try:
        yield RunningProxy(server, app, pool, made)
    finally:
        server.close()
