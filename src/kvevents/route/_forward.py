"""One client request forwarded: its attempts on the engines, and the answer passed through.

The body goes to the engine as the client sent it; the headers too, except the hop-by-hop
ones, ``Host`` (the engine's) and ``Content-Length`` (recomputed over the same bytes). The
answer comes back as the engine sent it: its status, its headers (minus hop-by-hop ones and
``Date``/``Server``, which the proxy's server writes itself), its body chunk by chunk, read
from the engine only as fast as the client takes it; plus ``x-kvevents-engine`` and, for a
planned request, ``x-kvevents-predicted-cached-tokens``.

An attempt that fails before anything was sent to the client (no connection, the connection
lost, a 5xx) is retried on the next engine; an engine that refused the connection or
answered a 5xx is marked down. After the first byte the request is not retried: a stream
whose engine is lost (gone, or silent for ``idle_timeout``) is continued on the next engine
when it can be (:mod:`kvevents.route._resume`); any other answer cut off (or a stream no
engine could continue) closes the client's connection, so the client sees it incomplete. A
client that goes away cancels the attempt and closes its connection to the engine, which
makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from time import monotonic, perf_counter
from typing import Literal

from starlette.types import Receive, Scope, Send

from kvevents.http import ABORT
from kvevents.route._client import EngineClient, EngineResponse, Origin, Timeouts, UpstreamError
from kvevents.route._engines import Engine, EnginePool
from kvevents.route._metrics import ProxyCounts, ProxyMetrics
from kvevents.route._options import ProxyOptions
from kvevents.route._replies import OpenAIError, send_json
from kvevents.route._resume import Continuable, Splice, Transcript
from kvevents.route._seam import Outcome, OutcomeKind, Plan, Planner
from kvevents.route._sse import SseUsage
from kvevents.route._usage import BodyUsage, Usage

__all__ = ["RANK_HEADER", "Exchange", "Upstream", "request_headers", "response_headers"]

log = logging.getLogger("kvevents.route.proxy")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
    }
)
# Not forwarded to the engine: the client writes the engine's Host and the body's length, and
# the client's Expect was answered by the proxy's server.
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# Not returned to the client: uvicorn writes its own Date and Server.
_NOT_RETURNED = HOP_BY_HOP | {b"date", b"server"}
#: The header vLLM's OpenAI server reads to run a request on one data parallel rank.
RANK_HEADER = b"x-data-parallel-rank"


def _named_by_connection(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The header names a ``Connection`` header lists: hop-by-hop too (RFC 9110, 7.6.1)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    }


def request_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers to send on, as the client sent them."""
    dropped = _NOT_FORWARDED | _named_by_connection(raw)
    return [(k, v) for k, v in raw if k.lower() not in dropped]


def header_lines(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """``headers`` as the lines of a request head, each ending in CRLF."""
    return b"".join([b"%s: %s\r\n" % pair for pair in headers])


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine's headers to return (names as the engine spelled them)."""
    dropped = _NOT_RETURNED | _named_by_connection(raw)
    return [(k, v) for k, v in raw if k.lower() not in dropped]


class Upstream:
    """What every exchange shares: the engines, the planner, the connections to the engines
    (:attr:`client`, closed by :meth:`aclose`), the options and the counters."""

    def __init__(
        self,
        pool: EnginePool,
        planner: Planner,
        options: ProxyOptions,
        counts: ProxyCounts,
        metrics: ProxyMetrics,
    ) -> None:
        self.pool = pool
        self.planner = planner
        self.options = options
        self.counts = counts
        self.metrics = metrics
        self.in_flight = 0
        self.client = EngineClient(options.keepalive_timeout)
        self.timeouts = Timeouts(
            options.connect_timeout, options.first_byte_timeout, options.idle_timeout
        )
        self._origins: dict[str, Origin] = {}

    async def aclose(self) -> None:
        await self.client.aclose()

    def origin(self, engine: Engine) -> Origin:
        origin = self._origins.get(engine.url)
        if origin is None:
            origin = self._origins[engine.url] = Origin.of(engine.url)
        return origin


#: How an attempt failed: an outcome kind, or an answer over the size limit.
FailureKind = Literal["connect_error", "http_error", "timeout", "reset", "too_large"]


class _Failed(Exception):
    """An attempt that failed: ``kind``, why, the engine's status if it answered."""

    def __init__(self, kind: FailureKind, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.status = status


@dataclass
class _Attempt:
    """Where one attempt stands (what its :class:`Outcome` reports)."""

    engine: Engine
    kind: OutcomeKind = "ok"
    status: int | None = None
    first_byte: float | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class _Broken:
    """An answer that began and broke off on ``engine`` (``reason``), being continued: the
    client has ``tokens`` of it."""

    engine: Engine
    reason: str
    tokens: int


def _target(scope: Scope) -> bytes:
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


def _uncancel(task: asyncio.Task[object] | None) -> None:
    if sys.version_info >= (3, 11) and task is not None:
        task.uncancel()  # our own cancel (the client left), consumed: the task ends normally


class Exchange:
    """One client request: tried on engines in order until one answers (:meth:`run`), under
    a watch for the client going away (:meth:`guarded`).

    ``status`` and ``engine``: what the client got (None: nothing yet); ``gone``: the
    client went away first.
    """

    def __init__(
        self,
        upstream: Upstream,
        scope: Scope,
        send: Send,
        body: bytes,
        began: float,
        *,
        model: str | None = None,
        plan: Plan | None = None,
    ) -> None:
        self.up = upstream
        self._send = send
        self._method: str = scope["method"]
        self._target = _target(scope)
        self._headers = request_headers(scope["headers"])
        self._lines = header_lines(self._headers)
        self._body = body
        self.began = began
        self.model = model
        self.plan = plan
        self.status: int | None = None
        self.engine: Engine | None = None
        self.gone = False
        #: How to continue this stream elsewhere should its engine be lost (None: it cannot).
        self.continuable: Continuable | None = None
        self._transcript: Transcript | None = None  # what the client was sent of a stream
        self._broken: _Broken | None = None  # the answer broke off: now being continued
        self._complete = False  # the answer has ended: a disconnect now is no cancel
        # Closes the client's connection mid-answer, and says when the client left
        # (kvevents.http.ABORT).
        abort = scope.get("extensions", {}).get(ABORT, {})
        self._abort: Callable[[], None] | None = abort.get("close")
        self._hold_head: Callable[[], None] | None = abort.get("hold_head")
        self._hold_chunks: Callable[[Sequence[bytes]], bool] | None = abort.get("hold_chunks")
        self._on_disconnect: Callable[[Callable[[], None]], None] | None = abort.get(
            "on_disconnect"
        )

    # ------------------------------------------------------------------ the client's side

    async def guarded(self, receive: Receive, work: Awaitable[None]) -> None:
        """Run ``work``, cancelled if the client disconnects before it is done: told by the
        server (its on_disconnect), else by a task waiting for ``http.disconnect``."""
        task = asyncio.current_task()
        watcher = None
        if self._on_disconnect is not None:
            self._on_disconnect(functools.partial(self._left, task))
        else:
            watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))
        try:
            await work
        except asyncio.CancelledError:
            if not self.gone:
                raise
            _uncancel(task)
            self.up.counts.client_disconnects += 1
        finally:
            self._complete = True
            if watcher is not None:
                watcher.cancel()

    def _left(self, task: asyncio.Task[object] | None) -> None:
        """The client went away: cancel its request, unless its answer has ended."""
        if not self._complete and task is not None:
            self.gone = True
            task.cancel()

    async def _watch(self, receive: Receive, task: asyncio.Task[object] | None) -> None:
        # The body is read: the next message is http.disconnect, when the client leaves or
        # when the answer is complete.
        while (await receive())["type"] != "http.disconnect":
            pass
        self._left(task)

    async def refuse(self, error: OpenAIError) -> None:
        """Answer ``error`` (nothing else was sent)."""
        await self.refuse_with(error.status, error.payload)

    async def refuse_with(self, status: int, payload: bytes) -> None:
        """Answer ``status`` with the JSON ``payload`` (nothing else was sent)."""
        self.status = status
        self._complete = True
        await send_json(self._send, status, payload)

    # ------------------------------------------------------------------ the engines' side

    async def run(self, engines: Iterable[Engine]) -> None:
        """Try ``engines`` in order (skipping any down by then), then the pool's other healthy
        engines serving the model; answer 503 or 502 when none could answer (or cut off a
        stream that broke off when none could continue it)."""
        failures: list[str] = []
        tried: list[Engine] = []
        for engine in self._order(engines, tried):
            if tried:
                self.up.counts.retries += 1
            tried.append(engine)
            if await self._attempt(engine, failures):
                return
        broken = self._broken
        if broken is not None:
            self._cut(broken.engine, f"{broken.reason}; no engine could continue it")
            return
        await self._give_up(failures)

    def _order(self, first: Iterable[Engine], tried: list[Engine]) -> Iterator[Engine]:
        for engine in first:
            if engine.up and engine not in tried:
                yield engine
        for engine in self.up.pool.healthy(self.model):
            if engine not in tried:
                yield engine

    async def _give_up(self, failures: list[str]) -> None:
        counts = self.up.counts
        if failures:
            counts.upstream_failures += 1
            message = f"no engine could answer: {'; '.join(failures)}"
            log.warning("%s %s: %s", self._method, self._path, message)
            await self.refuse(OpenAIError(502, message, code="upstream_error"))
            return
        counts.no_engine += 1
        error = self.up.pool.unavailable(self.model)
        await self.refuse(error or OpenAIError(503, "no healthy engine", code="no_healthy_engine"))

    async def _attempt(self, engine: Engine, failures: list[str]) -> bool:
        """One attempt on ``engine``; True when the client got its answer (or a final error)."""
        attempt = self._begin(engine)
        response: EngineResponse | None = None
        try:
            response = await self._open(engine)
            return await self._relay(attempt, response)
        except _Failed as failed:
            return await self._failed(attempt, failed, failures)
        except asyncio.CancelledError:
            if self.gone:
                attempt.kind = "client_gone"
                engine.counts.client_gone += 1
            raise
        finally:
            if response is not None:
                # A complete answer's connection is already back in the pool; any other is
                # closed, so the engine sees its client go.
                response.release() if attempt.kind == "ok" else response.close()
            self._end(attempt)

    def _begin(self, engine: Engine) -> _Attempt:
        engine.in_flight += 1
        engine.counts.requests += 1
        return _Attempt(engine)

    def _started(self, engine: Engine) -> None:
        """The planner's bookkeeping of an attempt, once its request is on its way
        (:meth:`EngineClient.request`'s ``on_sent``)."""
        if self.plan is not None:
            self._tell_planner("started", self.up.planner.started, self.plan, engine)

    def _end(self, attempt: _Attempt) -> None:
        engine = attempt.engine
        engine.in_flight -= 1
        if self.plan is None:
            return
        usage = attempt.usage
        outcome = Outcome(
            status=attempt.status,
            kind=attempt.kind,
            prompt_tokens=None if usage is None else usage.prompt_tokens,
            cached_tokens=None if usage is None else usage.cached_tokens,
            first_byte_s=None if attempt.first_byte is None else attempt.first_byte - self.began,
            total_s=perf_counter() - self.began,
            completion_tokens=None if usage is None else usage.completion_tokens,
        )
        self._tell_planner("finished", self.up.planner.finished, self.plan, engine, outcome)

    def _tell_planner(self, what: str, call: Callable[..., object], *args: object) -> None:
        try:
            call(*args)
        except Exception:  # a planner's bug must not fail a request that is being answered
            self.up.counts.planner_errors += 1
            log.exception("the planner's %s() failed", what)

    @property
    def _path(self) -> str:
        return self._target.decode("latin-1")

    async def _open(self, engine: Engine) -> EngineResponse:
        """The engine's response headers, or :class:`_Failed`."""
        up = self.up
        lines = self._lines if engine.rank is None else self._ranked(engine.rank)
        try:
            response = await up.client.request(
                up.origin(engine),
                self._method.encode(),
                self._target,
                lines,
                self._body,
                up.timeouts,
                functools.partial(self._started, engine),
            )
        except UpstreamError as exc:
            if exc.kind == "connect_error":
                raise _Failed("connect_error", exc.reason) from None
            if exc.kind == "timeout":
                raise _Failed("timeout", exc.reason) from None
            raise _Failed("reset", f"connection lost before the answer ({exc.reason})") from None
        if response.status >= 500:
            response.close()
            raise _Failed("http_error", f"answered {response.status}", response.status)
        return response

    def _ranked(self, rank: int) -> bytes:
        """The header lines, asking a data parallel engine for ``rank`` (vLLM's header for
        it; a client's own rank header is replaced: the planner chose the rank)."""
        rest = [(k, v) for k, v in self._headers if k.lower() != RANK_HEADER]
        return header_lines([*rest, (RANK_HEADER, b"%d" % rank)])

    async def _failed(self, attempt: _Attempt, failed: _Failed, failures: list[str]) -> bool:
        """Count and report a failed attempt; True when it ends the request (not retried)."""
        engine, counts = attempt.engine, attempt.engine.counts
        attempt.status = failed.status
        failures.append(f"{engine.id}: {failed.reason}")
        if failed.kind == "connect_error" or failed.kind == "http_error":
            attempt.kind = failed.kind
            if failed.kind == "connect_error":
                counts.connect_errors += 1
            else:
                counts.http_errors += 1
            self.up.pool.mark_down(engine, f"{self._method} {self._path}: {failed.reason}")
            return False
        if failed.kind == "reset":
            attempt.kind = "reset"
            counts.resets += 1
            return False
        if self._broken is not None:  # a continuation that failed: the next engine may not
            if failed.kind == "timeout":
                attempt.kind = "timeout"
                counts.timeouts += 1
            else:
                attempt.kind = "reset"
                counts.too_large += 1
            return False
        # A timeout (the engine may still be working: another would only double the load) or
        # an answer over the size limit (another engine would send the same): not retried.
        self.up.counts.upstream_failures += 1
        log.warning("%s %s on %s: %s", self._method, self._path, engine.id, failed.reason)
        if failed.kind == "timeout":
            attempt.kind = "timeout"
            counts.timeouts += 1
            await self.refuse(OpenAIError(504, failed.reason, code="upstream_timeout"))
        else:
            attempt.kind = "reset"
            counts.too_large += 1
            await self.refuse(OpenAIError(502, failed.reason, code="upstream_too_large"))
        return True

    # ------------------------------------------------------------------ the answer

    async def _relay(self, attempt: _Attempt, response: EngineResponse) -> bool:
        """Pass the answer on; True when the client's answer is done (or was cut off), False
        when a stream broke off and is to be continued on the next engine.

        The status and headers wait for the body's first piece: vLLM sends a stream's headers
        before its prefill, and an engine that dies then has sent nothing that matters, so
        the request is retried elsewhere (:class:`_Failed` "reset") instead of being cut."""
        attempt.status = response.status
        stream = response.content_type == "text/event-stream"
        if self._broken is not None:
            return await self._continue(attempt, response, stream)
        limit = None if stream else self.up.options.max_response_bytes
        declared = response.content_length
        if limit is not None and declared is not None and declared > limit:
            raise _Failed("too_large", f"its answer of {declared} bytes is over {limit}")
        first = await self._first_piece(response)
        await self._start(attempt.engine, response)
        attempt.kind = "reset"  # until the body ends
        if stream and response.status == 200 and self.continuable is not None:
            self._transcript = self.continuable.transcript()
        try:
            await self._pass_body(attempt, response, stream, limit, first)
        except (_Failed, asyncio.TimeoutError, UpstreamError) as exc:
            return await self._broke(attempt, exc)
        return True

    async def _continue(self, attempt: _Attempt, response: EngineResponse, stream: bool) -> bool:
        """Splice a continuation's answer onto the client's stream (see :meth:`_broke`)."""
        broken, transcript, continuable = self._broken, self._transcript, self.continuable
        assert broken is not None and transcript is not None and continuable is not None
        if response.status != 200 or not stream:  # refused, by every engine alike
            attempt.kind = "reset"  # its connection closed, its body unread
            self._broken = None
            why = f"{attempt.engine.id} answered {response.status} to its continuation"
            self._cut(broken.engine, f"{broken.reason}; {why}")
            return True
        first = await self._first_piece(response)
        attempt.kind = "reset"  # until the body ends
        splice = Splice(transcript, broken.tokens, continuable.prompt_tokens)
        try:
            await self._pass_body(attempt, response, stream, None, first, splice)
        except (_Failed, asyncio.TimeoutError, UpstreamError) as exc:
            return await self._broke(attempt, exc)
        self._broken = None
        self.up.counts.continued += 1
        log.info(
            "%s %s: the answer cut off on %s (%s) was continued on %s after %d tokens",
            self._method,
            self._path,
            broken.engine.id,
            broken.reason,
            attempt.engine.id,
            broken.tokens,
        )
        return True

    async def _broke(self, attempt: _Attempt, exc: BaseException) -> bool:
        """A stream broke off after it began: continue it on the next engine when it can be
        (False: the request for it is ready), else end it (True)."""
        reason = self._count_break(attempt, exc)
        transcript, continuable = self._transcript, self.continuable
        if transcript is None or continuable is None or isinstance(exc, _Failed):
            self._cut(attempt.engine, reason)
            return True
        if transcript.blocked is not None:
            self._cut(attempt.engine, f"{reason}; not continued: {transcript.blocked}")
            return True
        if transcript.done or transcript.finished:  # only its end was lost: the client has it
            end = b"" if transcript.done else b"data: [DONE]\n\n"
            self._complete = True
            await self._send({"type": "http.response.body", "body": end, "more_body": False})
            if self._broken is not None:  # a continuation's end, lost: it was continued
                self._broken = None
                self.up.counts.continued += 1
            return True
        tokens = continuable.tokens(transcript)
        self._broken = _Broken(attempt.engine, reason, tokens)
        self._body = continuable.body(transcript, tokens)
        return False

    async def _first_piece(self, response: EngineResponse) -> tuple[bytes, bool]:
        """The body's first piece, or :class:`_Failed` (nothing went to the client yet)."""
        try:
            return await response.read()
        except asyncio.TimeoutError:
            wait = self.up.options.idle_timeout
            raise _Failed("timeout", f"no answer within {wait:g} s of its headers") from None
        except UpstreamError as exc:
            raise _Failed("reset", f"the answer broke off before its body ({exc.reason})") from None

    async def _start(self, engine: Engine, response: EngineResponse) -> None:
        headers = response_headers(response.headers)
        headers.append((b"x-kvevents-engine", engine.id.encode()))
        if self.plan is not None:
            predicted = self.plan.predicted_cached_tokens.get(engine.id, 0)
            headers.append((b"x-kvevents-predicted-cached-tokens", b"%d" % predicted))
            headers.extend(self.plan.headers)
        self.status, self.engine = response.status, engine
        if self._hold_head is not None:
            self._hold_head()  # the head goes with the first piece, in one write
        await self._send(
            {"type": "http.response.start", "status": response.status, "headers": headers}
        )

    async def _pass_body(
        self,
        attempt: _Attempt,
        response: EngineResponse,
        stream: bool,
        limit: int | None,
        first: tuple[bytes, bool],
        splice: Splice | None = None,
    ) -> None:
        """The body passed on (a continuation's through ``splice``): its first piece alone,
        at once, then whatever each read of the engine's connection brought, in one write."""
        # A continuation's usage is not the planned prompt's: not reported to the planner.
        usage = _usage_reader(response, stream) if splice is None else None
        transcript = self._transcript
        size, last = 0, False
        pending: tuple[bytes, bool] | None = first
        while not last:
            if pending is not None:
                pieces, last = [pending[0]], pending[1]
            else:
                pieces, last = await response.read_ready()
            size += sum(map(len, pieces))
            if limit is not None and size > limit:
                raise _Failed("too_large", f"its answer is over {limit} bytes")
            if splice is not None:
                pieces = [splice.feed(piece) for piece in pieces]
                if last:
                    pieces.append(splice.rest())
                pieces = [piece for piece in pieces if piece]
            self._complete = last
            if pending is not None:
                attempt.first_byte = perf_counter()
            await self._pass(pieces, last)
            if pending is not None:  # the first piece: its bookkeeping once it is on its way
                self._first_byte(attempt, stream and splice is None)
                pending = None
            for piece in pieces:
                if usage is not None and piece:
                    usage.feed(piece)
                if transcript is not None:
                    transcript.feed(piece)
        attempt.kind = "ok"
        attempt.usage = None if usage is None else usage.result()

    async def _pass(self, pieces: list[bytes], last: bool) -> None:
        """Send ``pieces`` to the client, each as the engine's chunk it was, in one write where
        the server can (``hold_chunks``), and the body's end after them when ``last``."""
        if len(pieces) > 1 and self._hold_chunks is not None and self._hold_chunks(pieces[:-1]):
            pieces = pieces[-1:]
        send, final = self._send, len(pieces) - 1
        for index, piece in enumerate(pieces):
            more = not last or index < final
            await send({"type": "http.response.body", "body": piece, "more_body": more})
        if last and not pieces:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _first_byte(self, attempt: _Attempt, timed: bool) -> None:
        """The answer's first piece went to the client (at ``attempt.first_byte``); ``timed``:
        a stream's first token (not a continuation's)."""
        attempt.engine.answered_at = monotonic()  # alive, whatever its /health says
        if timed:
            self.up.metrics.ttft.labels(attempt.engine.id).observe(
                (attempt.first_byte or perf_counter()) - self.began
            )
        if self.plan is not None:
            self._tell_planner("answering", self.up.planner.answering, self.plan, attempt.engine)

    def _count_break(self, attempt: _Attempt, exc: BaseException) -> str:
        """Count an answer that broke after it began; why it broke."""
        counts = attempt.engine.counts
        if isinstance(exc, _Failed):
            counts.too_large += 1
            return exc.reason
        if isinstance(exc, asyncio.TimeoutError):
            attempt.kind = "timeout"
            counts.timeouts += 1
            return f"silent for {self.up.options.idle_timeout:g} s"
        counts.resets += 1
        return exc.reason if isinstance(exc, UpstreamError) else _describe(exc)

    def _cut(self, engine: Engine, reason: str) -> None:
        """The answer ends unfinished: count it, say so once, close the client's connection
        (so it sees the answer incomplete; without the server's abort, returning an
        unfinished response closes it too)."""
        if self._abort is not None:
            self._abort()
        self.up.counts.truncated += 1
        log.warning(
            "%s %s: the answer from %s was cut off: %s", self._method, self._path, engine.id, reason
        )


def _usage_reader(response: EngineResponse, stream: bool) -> SseUsage | BodyUsage | None:
    if stream:
        return SseUsage()
    return BodyUsage() if response.content_type == "application/json" else None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
