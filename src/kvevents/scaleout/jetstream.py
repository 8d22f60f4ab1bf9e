"""The NATS side shared by relays and replicas: a client loop on its own thread, the stream.

``nats-py`` is asyncio; the relay and the replica are fed and read from threads (the
subscriber's I/O thread, HTTP handlers), so each runs one event loop on a thread of its own
(:class:`LoopThread`) and hands coroutines to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from kvevents.ratelimit import RateLimitedWarning
from kvevents.scaleout.records import DEFAULT_PREFIX, DEFAULT_STREAM

__all__ = ["JetStreamOptions", "LoopThread", "StreamConfigError", "connect", "ensure_stream"]

T = TypeVar("T")

log = logging.getLogger("kvevents.scaleout.jetstream")
# A server restarting makes the client report every failed attempt (5 a second): one line
# per URL per 10 s says it, with how many were held back.
_warn = RateLimitedWarning(log, 10.0)


@dataclass(frozen=True)
class JetStreamOptions:
    """Where the events live in JetStream.

    ``stream``: the stream's name; ``prefix``: its subjects' first token; ``duplicate_window``:
    seconds JetStream remembers message ids (copies written later are dropped by the
    replicas' cursors); ``max_age``: seconds a message is kept at most (0: until trimmed
    below a snapshot); ``bucket``: the object store bucket of snapshots; ``replicas``: the
    stream's copies in a NATS cluster (1 for one server).
    """

    stream: str = DEFAULT_STREAM
    prefix: str = DEFAULT_PREFIX
    duplicate_window: float = 120.0
    max_age: float = 0.0
    bucket: str = "kvevents-snapshots"
    replicas: int = 1
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.duplicate_window <= 0 or self.max_age < 0 or self.replicas < 1:
            raise ValueError("duplicate_window must be > 0, max_age >= 0 and replicas >= 1")


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it (TimeoutError after ``timeout``)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    def close(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


_RECONNECT_WAIT = 0.2


async def connect(url: str, options: JetStreamOptions, name: str) -> Any:
    """A NATS connection: the first one fails after about ``connect_timeout`` (a wrong URL is
    an error at start), once made it reconnects for ever (a server restart is a pause)."""
    import nats

    async def on_error(exc: Exception) -> None:
        _warn(url, "nats %s: %r (reconnecting)", url, exc)

    nc = await nats.connect(
        url,
        name=name,
        connect_timeout=options.connect_timeout,
        reconnect_time_wait=_RECONNECT_WAIT,
        max_reconnect_attempts=max(1, int(options.connect_timeout / _RECONNECT_WAIT)),
        allow_reconnect=True,
        error_cb=on_error,
    )
    nc.options["max_reconnect_attempts"] = -1  # read at each reconnect, not only at start
    return nc


class StreamConfigError(ValueError):
    """The JetStream stream cannot be used as configured; the message names the stream, its
    subjects, what conflicts, and the fix."""


async def ensure_stream(js: Any, options: JetStreamOptions, *, writes: bool = False) -> None:
    """Create the stream unless it exists (a relay or a replica may start first).

    ``writes``: the caller publishes to ``<prefix>.>`` (a relay), so an existing stream must
    store those subjects. StreamConfigError when the stream cannot be created or used.
    """
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(options.stream)
    except NotFoundError:
        await _add_stream(js, options)
        return
    if writes:
        _check_subjects(options, list(info.config.subjects or []))


async def _add_stream(js: Any, options: JetStreamOptions) -> None:
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import BadRequestError, NotFoundError

    config = StreamConfig(
        name=options.stream,
        subjects=[f"{options.prefix}.>"],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=options.duplicate_window,
        max_age=options.max_age or None,
        num_replicas=options.replicas,
    )
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        with contextlib.suppress(NotFoundError):
            await js.stream_info(options.stream)
            return  # another relay or replica created it meanwhile
        raise StreamConfigError(await _refusal(js, options, exc)) from None


async def _refusal(js: Any, options: JetStreamOptions, exc: Any) -> str:
    """Why the server refused to create the stream, with the streams that hold its subjects."""
    ours = f"{options.prefix}.>"
    said = getattr(exc, "description", None) or repr(exc)
    head = f"cannot create JetStream stream {options.stream!r} for subjects {ours!r} ({said})"
    try:
        streams = await js.streams_info()
    except Exception:  # the refusal is the news; the list only helps
        return head
    holders = [
        (s.config.name, list(s.config.subjects or []))
        for s in streams
        if any(subjects_overlap(ours, other) for other in s.config.subjects or [])
    ]
    if not holders:
        return head
    name, subjects = holders[0]
    return (
        f"{head}: stream {name!r} already holds subjects {subjects} (a subject belongs to one "
        f"stream); give every relay and replica of this index the same stream name "
        f"(--nats-stream {name}), or give this index another prefix (--nats-prefix)"
    )


def _check_subjects(options: JetStreamOptions, subjects: list[str]) -> None:
    samples = (f"{options.prefix}.ev.w.0", f"{options.prefix}.reg.w")
    if all(any(subject_matches(s, pattern) for pattern in subjects) for s in samples):
        return
    raise StreamConfigError(
        f"JetStream stream {options.stream!r} stores subjects {subjects}, not "
        f"'{options.prefix}.>': what a relay writes there would not be kept; use the prefix "
        "the stream was created with (--nats-prefix), or another stream (--nats-stream)"
    )


def subject_matches(subject: str, pattern: str) -> bool:
    """True when the literal ``subject`` matches the NATS ``pattern`` (``*``, ``>``)."""
    tokens, wanted = subject.split("."), pattern.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or token not in ("*", tokens[i]):
            return False
    return len(tokens) == len(wanted)


def subjects_overlap(a: str, b: str) -> bool:
    """True when some subject matches both NATS patterns ``a`` and ``b``."""
    left, right = a.split("."), b.split(".")
    for x, y in zip(left, right, strict=False):
        if ">" in (x, y):
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(left) == len(right)
