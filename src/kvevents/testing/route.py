"""Test doubles for the front door: a stand-in planner, and a proxy in front of stand-in engines.

:class:`RoundRobinPlanner` plans as a router without an index would: the healthy engines
serving the model, in turn, no predicted cache. It records every call the proxy makes
(``plans``, ``started``, ``finished``), so a test can assert what the planner was told.
:func:`running_proxy` starts :class:`kvevents.route.RouteApp` on a server thread in front
of given engine URLs and stops it afterwards (:class:`RunningProxy`). :class:`RouteProcess`
runs ``kvevents route`` itself in a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

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

__all__ = ["RoundRobinPlanner", "RouteProcess", "RunningProxy", "running_proxy"]


class RoundRobinPlanner:
    """The healthy engines serving the request's model, starting one further each time
    (``rotate=False``: always in pool order).

    ``predicted``: engine id -> the predicted cached tokens to report (default none).
    ``plans``, ``sent`` (each ``started``), ``answered`` (each ``answering``), ``ended`` (each
    ``finished``): what the proxy
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
        self.answered: list[tuple[Plan, Engine]] = []
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

    def answering(self, plan: Plan, engine: Engine) -> None:
        with self._lock:
            self.answered.append((plan, engine))

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
    planner: Any  # the test's planner: a stand-in's records (plans, started) are read

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
    **app_options: Any,  # the test fixture forwards any app keyword
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


class RouteProcess:
    """``kvevents route`` (or any command printing ``serving on URL``) in a subprocess.

    :meth:`start` returns once it printed its URL (bounded by ``timeout``); :meth:`stop`
    sends SIGTERM and returns the exit status (SIGKILL after ``timeout``). ``out`` holds its
    standard output after that first line, ``err`` its standard error, once stopped.
    """

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "kvevents.cli", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.url = ""
        self.out = ""
        self.err = ""
        self._proc: subprocess.Popen[str] | None = None
        # Each stream read whole by a thread of its own (a readline of the first line reads
        # ahead, and what it read ahead would be lost to a later communicate()).
        self._lines: list[str] = []
        self._errors: list[str] = []
        self._readers: list[threading.Thread] = []
        self._first = threading.Event()

    def start(self, timeout: float = 60.0) -> RouteProcess:
        self._proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self._proc.stdout, self._lines), daemon=True),
            threading.Thread(
                target=self._read, args=(self._proc.stderr, self._errors), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()
        self._first.wait(timeout)
        first = self._lines[0] if self._lines else ""
        if not first.startswith("serving on "):
            status = self.stop()
            raise RuntimeError(f"{' '.join(self.args)} did not start (exit {status}): {self.err}")
        self.url = first.removeprefix("serving on ").strip()
        return self

    def _read(self, stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line)
            if into is self._lines:
                self._first.set()
        self._first.set()  # the end: no first line is coming

    def stop(self, timeout: float = 30.0) -> int:
        proc, self._proc = self._proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        self.out = "".join(self._lines[1:])
        self.err = "".join(self._errors)
        return proc.returncode

    def __enter__(self) -> RouteProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
