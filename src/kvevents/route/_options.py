"""What the proxy allows its clients and waits for from its engines."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvevents.http import HttpLimits

__all__ = ["ProxyOptions"]


@dataclass(frozen=True)
class ProxyOptions:
    """Bounds on the proxy's clients (``limits``, as in ``kvevents serve``) and on each
    request it sends to an engine.

    ``connect_timeout``: seconds to open a connection to an engine (a dead host fails here
    and the next engine is tried). ``first_byte_timeout``: seconds from sending a request to
    the engine's response headers; a non-streamed completion sends them only when it is
    done, so this bounds a whole generation (504 after it, not retried: the engine may still
    be working on it). ``idle_timeout``: seconds the engine may go without sending any body
    data (between two tokens of a stream, or before the first one after a queue); the answer
    is cut off after it. ``max_response_bytes``: the largest answer that is not a stream
    (502 when its content-length says more; cut off when it sends more); streams are
    unbounded in size but read only as fast as the client reads. ``keepalive_timeout``:
    seconds an idle connection to an engine is kept for reuse; below uvicorn's default of
    5 s (vLLM's), so the proxy never reuses a connection the engine is closing.
    ``continue_streams``: a stream whose engine is lost mid-answer is continued on another
    engine (:mod:`kvevents.route._resume`) instead of being cut off.
    """

    connect_timeout: float = 2.0
    first_byte_timeout: float = 600.0
    idle_timeout: float = 300.0
    max_response_bytes: int = 64 << 20
    keepalive_timeout: float = 4.0
    continue_streams: bool = True
    limits: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"ProxyOptions.{spec.name} must be > 0, got {value!r}")
