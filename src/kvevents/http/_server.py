"""The HTTP server thread: uvicorn on a socket bound before it starts, with client limits.

Each connection runs :class:`~kvevents.http._protocol.LimitedProtocol`: the header deadline,
header size and connection cap, and ``POST /query`` answered on the connection. Other bodies'
limits are enforced by the app (:func:`~kvevents.http._limits.read_body`).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from prometheus_client.registry import Collector
from starlette.routing import Route
from starlette.types import ASGIApp

from kvevents.http._app import AppOptions, create_app
from kvevents.http._digest import DigestExtra
from kvevents.http._limits import HttpCounters, HttpLimits
from kvevents.http._protocol import LimitedProtocol
from kvevents.http._query import QueryHandler
from kvevents.service.core import IndexService

__all__ = ["Server", "serve"]


class Server:
    """A uvicorn server on a background thread, bound before it starts (port 0 works).

    ``port`` and ``url`` are known as soon as the object exists; :meth:`start` returns once
    the server accepts connections; :meth:`close` stops it; :meth:`wait` blocks until it stops.
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: HttpLimits | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        # ``sock``: already bound (by serve(), which needs the port before the app exists).
        self._sock = sock if sock is not None else _bound_socket(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        limits = limits if limits is not None else HttpLimits()
        # No proxy-headers layer: client addresses are only used by the access log, and that
        # is off (each layer costs every request).
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            access_log=False,
            proxy_headers=False,
            http=LimitedProtocol.configured(limits, _counters_of(app), _query_handler_of(app)),
            timeout_keep_alive=max(1, min(5, int(limits.header_timeout))),
        )
        self._server = uvicorn.Server(config)
        self._failure: BaseException | None = None
        # Set when the server thread ends. Not Thread.is_alive(): on Python 3.11 a Ctrl-C that
        # interrupts Thread.join() can leave is_alive() False while the thread still runs, and
        # the service would then never be shut down.
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvevents-http", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # uvicorn exits with SystemExit when startup fails
            self._failure = exc
        finally:
            self._done.set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Server:
        """Run the server; return once it accepts connections (errors close the socket)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._done.is_set():
                self.close()
                raise RuntimeError(
                    f"the HTTP server on {self.url} stopped during startup ({self._failure!r})"
                )
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the HTTP server on {self.url} did not start in {timeout} s")
            time.sleep(0.005)
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.ident is not None:
            self._done.wait(timeout)
        self._sock.close()

    def wait(self) -> None:
        try:
            while not self._done.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _counters_of(app: ASGIApp) -> HttpCounters:
    """The app's counters (``create_app`` and the front door's app set them in ``app.state``),
    or new ones nobody reads."""
    counters = getattr(getattr(app, "state", None), "http_counters", None)
    return counters if isinstance(counters, HttpCounters) else HttpCounters()


def _query_handler_of(app: ASGIApp) -> QueryHandler | None:
    """The app's ``POST /query`` handler, for the protocol to answer queries with
    (``create_app`` sets it), if any: an app without one (the front door) has none."""
    handler = getattr(getattr(app, "state", None), "query_handler", None)
    return handler if isinstance(handler, QueryHandler) else None


def _bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle's algorithm and delayed ACKs add 40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind http://{host}:{port}: {exc.strerror}") from exc
    sock.listen(1024)
    return sock


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    service: IndexService | None = None,
    collectors: Sequence[Collector] = (),
    options: AppOptions | None = None,
    routes: Sequence[Route] = (),
    digest_extra: DigestExtra | None = None,
    # Whatever IndexService takes, passed on as they are: its own signature checks them.
    **service_options: Any,
) -> Server:
    """Start the index service over HTTP in the background; returns the started server.

    ``service_options`` go to :class:`IndexService` when no service is given. ``options``:
    token, endpoint allow-list and client limits (the server's own port is always refused
    as an endpoint); ``routes``: more routes for the app; ``digest_extra``: more members of
    ``GET /digest``'s answer. Call ``server.wait()`` to block (the CLI does),
    ``server.close()`` to stop.
    """
    service = service if service is not None else IndexService(**service_options)
    options = options if options is not None else AppOptions()
    sock = _bound_socket(host, port)
    endpoints = options.endpoints.with_forbidden_port(sock.getsockname()[1])
    options = dataclasses.replace(options, endpoints=endpoints)
    app = create_app(
        service, collectors=collectors, options=options, routes=routes, digest_extra=digest_extra
    )
    server = Server(app, host, port, limits=options.limits, sock=sock)
    try:
        service.start()  # here, so that a feed that cannot start raises in the caller
    except BaseException:
        server.close()
        raise
    return server.start()
