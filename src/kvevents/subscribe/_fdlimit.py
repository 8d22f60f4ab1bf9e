"""How many file descriptors the subscriber's sockets need, and making room for them.

A ZeroMQ socket holds two descriptors once connected (its mailbox and its connection); a
subscriber reading 4,096 streams needs over 8,000, past the 1,024 many systems start a
process with. The soft limit is raised toward the hard one as streams are added; past the
hard limit a stream is refused with a reason rather than letting libzmq run out mid-flight.
"""

from __future__ import annotations

from collections.abc import Callable

from kvevents.subscribe._streams import ReplayOptions

try:
    import resource
except ImportError:  # not on Windows: the limit cannot be read there, so it is not checked
    resource = None  # type: ignore[assignment]  # the module or None: callers check first

__all__ = ["FDS_PER_SOCKET", "FD_HEADROOM", "fds_needed", "make_room", "room_for_stream"]

FDS_PER_SOCKET = 2
# Descriptors the rest of the process may hold: files, logs, other contexts, an HTTP server.
FD_HEADROOM = 256

Limits = tuple[int, int]
# Sockets of a subscriber that are not a stream's: the wake-up pair.
_OWN_SOCKETS = 2


def room_for_stream(streams: int, max_sockets: int, replay: ReplayOptions) -> str | None:
    """None when a subscriber reading ``streams`` streams can open one more, else why not
    (its socket limit, or the descriptors the process may have)."""
    limit = max_sockets - replay.max_concurrent - _OWN_SOCKETS
    if streams >= limit:
        return (
            f"the subscriber reads {streams} streams, its limit with "
            f"max_sockets={max_sockets} (SubscriberOptions.max_sockets)"
        )
    return make_room(fds_needed(streams + 1 + replay.max_concurrent + _OWN_SOCKETS))


def fds_needed(sockets: int) -> int:
    """Descriptors a process with ``sockets`` ZeroMQ sockets should be allowed."""
    return sockets * FDS_PER_SOCKET + FD_HEADROOM


def make_room(
    needed: int,
    get: Callable[[], Limits] | None = None,
    set_soft: Callable[[int, int], None] | None = None,
) -> str | None:
    """Make sure ``needed`` descriptors fit: None when they do (after raising the soft
    limit toward the hard one if needed), else why they cannot."""
    if resource is None and get is None:
        return None
    soft, hard = get() if get is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = -1 if resource is None else resource.RLIM_INFINITY
    if soft == unlimited or needed <= soft:
        return None
    if hard != unlimited and needed > hard:
        return f"needs about {needed} file descriptors; the hard limit (RLIMIT_NOFILE) is {hard}"
    # Double what is needed now so that adding streams one by one raises it rarely.
    target = needed * 2 if hard == unlimited else min(hard, needed * 2)
    try:
        if set_soft is not None:
            set_soft(target, hard)
        else:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return f"needs about {needed} file descriptors; raising the soft limit {soft} failed: {exc}"
    return None
