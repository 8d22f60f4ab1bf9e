"""Every exception kvevents raises.

::

    KVEventsError
    ├── LayoutError (also ValueError)     an endpoint or rank layout breaks a rule (.endpoint, .rank, .rule)
    ├── DecodeError (also ValueError)     a message cannot be read at all (.seq, .path)
    ├── PublisherError
    │   ├── BindError                     a socket could not bind (.endpoint, .rank, .role)
    │   └── PublisherClosed               publish() after shutdown(): you closed it
    ├── SubscriberError
    │   ├── SubscriberClosed              the subscriber was closed: you closed it
    │   └── StreamAddError                a stream could not be added; the others run on
    │                                     (.worker_id, .rank, .endpoint, .reason)
    ├── TraceError (also ValueError)      a workload trace row cannot be read (.path, .line)
    ├── DiscoveryError (also ValueError)  an engine's advertised endpoints cannot be read
    │                                     (.url, .key, .reason)
    ├── RegistrationConflict (also ValueError)  a rank added on its own does not fit its
    │                                     worker's registration (.worker_id, .rank, .field)
    ├── TokenizerNotFound (also LookupError)  a model's tokenizer is neither in a directory
    │                                     nor in the local Hugging Face cache (.source)
    └── SyncTimeout (also TimeoutError)   a simulated cluster's index did not catch up (.lagging)

Invalid configuration raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field.
Losses (dropped batches, skipped events, gaps) are never exceptions: they are counted in the
``stats()`` records.
"""

from __future__ import annotations

__all__ = [
    "BindError",
    "DecodeError",
    "DiscoveryError",
    "KVEventsError",
    "LayoutError",
    "PublisherClosed",
    "PublisherError",
    "RegistrationConflict",
    "StreamAddError",
    "SubscriberClosed",
    "SubscriberError",
    "SyncTimeout",
    "TokenizerNotFound",
    "TraceError",
]


class KVEventsError(Exception):
    """Base class of every kvevents exception."""


class LayoutError(KVEventsError, ValueError):
    """An endpoint, or the layout of endpoints over ranks, breaks a rule."""

    def __init__(self, message: str, *, endpoint: str, rank: int | None, rule: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.rank = rank
        self.rule = rule


class DecodeError(KVEventsError, ValueError):
    """A message (not just one event of it) cannot be decoded.

    ``seq`` is the sequence number of the message when known; ``path`` says where in the
    message the problem is, e.g. ``"$[1]"`` for the events array of a batch.
    """

    def __init__(self, message: str, *, seq: int | None = None, path: str = "$") -> None:
        where = f"at {path}" if seq is None else f"at {path} of seq {seq}"
        super().__init__(f"{message} ({where})")
        self.reason = message
        self.seq = seq
        self.path = path


class PublisherError(KVEventsError):
    """A publisher failed."""


class BindError(PublisherError):
    """A publisher socket could not bind its endpoint."""

    def __init__(self, message: str, *, endpoint: str, rank: int, role: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.rank = rank
        self.role = role


class PublisherClosed(PublisherError):
    """The publisher was shut down by its owner and accepts no more batches."""


class SubscriberError(KVEventsError):
    """A subscriber failed."""


class SubscriberClosed(SubscriberError):
    """The subscriber was closed by its owner."""


class StreamAddError(SubscriberError):
    """A stream could not be added to a subscriber: ``reason`` says why (socket or file
    descriptor limit, connect refused by ZeroMQ, I/O thread not running or not answering).
    Every other stream of the subscriber keeps running."""

    def __init__(self, *, worker_id: str, rank: int, endpoint: str, reason: str) -> None:
        super().__init__(
            f"cannot add the stream of worker {worker_id!r} rank {rank} ({endpoint}): {reason}"
        )
        self.worker_id = worker_id
        self.rank = rank
        self.endpoint = endpoint
        self.reason = reason


class RegistrationConflict(KVEventsError, ValueError):
    """A rank registered on its own (``dp_rank``) does not fit the worker's other ranks:
    ``field`` is ``"rank"`` (already registered), ``"model_name"``, ``"block_size"`` or
    ``"report_mode"`` (the worker's differ; ``existing`` and ``requested`` hold both values).
    Nothing was changed."""

    def __init__(
        self, *, worker_id: str, rank: int, field: str, existing: object, requested: object
    ) -> None:
        if field == "rank":
            message = f"worker {worker_id!r} rank {rank} is already registered"
        else:
            message = (
                f"worker {worker_id!r} is registered with {field} {existing!r}; "
                f"rank {rank} asks for {requested!r}"
            )
        super().__init__(message)
        self.worker_id = worker_id
        self.rank = rank
        self.field = field
        self.existing = existing
        self.requested = requested


class TokenizerNotFound(KVEventsError, LookupError):
    """No tokenizer could be loaded from ``source`` (a directory or a model id already in the
    local Hugging Face cache: nothing is downloaded); ``reason`` says what was tried."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"no tokenizer for {source!r}: {reason}")
        self.source = source
        self.reason = reason


class TraceError(KVEventsError, ValueError):
    """A row of a workload trace is malformed; ``line`` is 1-based."""

    def __init__(self, message: str, *, path: str, line: int) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


class DiscoveryError(KVEventsError, ValueError):
    """An engine's advertised KV event endpoints could not be read from ``url``: ``key`` is
    the missing or invalid field (None when the request itself failed), ``reason`` why."""

    def __init__(self, url: str, reason: str, *, key: str | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.key = key
        self.reason = reason


class SyncTimeout(KVEventsError, TimeoutError):
    """A simulated cluster's subscriber did not deliver everything published in time.

    ``lagging`` maps each lagging ``(worker_id, rank)`` to ``(delivered_seq, published_seq)``
    (``-1``: nothing yet).
    """

    def __init__(self, timeout: float, lagging: dict[tuple[str, int], tuple[int, int]]) -> None:
        where = ", ".join(
            f"{w}/rank{r} delivered {d} of {p}" for (w, r), (d, p) in sorted(lagging.items())
        )
        super().__init__(f"index not caught up after {timeout:g}s: {where}")
        self.timeout = timeout
        self.lagging = lagging
