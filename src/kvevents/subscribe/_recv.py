"""Receive whole ZeroMQ messages a burst at a time, for the subscriber's I/O thread.

``kvevents.subscribe._zmqrecv`` calls the libzmq pyzmq loaded (found by
:func:`kvevents._libzmq.direct_library`) once per burst instead of pyzmq's calls per frame;
where it is not built, or the library cannot be found, pyzmq receives instead, with the same
results.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import zmq

from kvevents._libzmq import Socket, direct_library

__all__ = ["Burst", "Received", "burst_receiver_for", "native_receive"]

#: One message: ``(seq, payload)`` for a live batch message (three frames, the second an
#: 8-byte big-endian sequence), else the list of its frames, for the caller to judge.
Received: TypeAlias = tuple[int, bytes] | list[bytes]
#: ``burst(max_messages, max_bytes)``: the messages waiting, up to ``max_messages`` and
#: stopping once their frames reach ``max_bytes`` (at least one is taken); empty when none.
Burst: TypeAlias = Callable[[int, int], list[Received]]
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_receiver: Any = None  # our C extension, which has no type stubs
_receiver_searched = False


def _native_receiver() -> Any:  # our C extension, which has no type stubs
    """``kvevents._zmqrecv`` wired to the libzmq pyzmq loaded, or None when unavailable."""
    global _receiver, _receiver_searched
    if _receiver_searched:
        return _receiver
    _receiver_searched = True
    lib = direct_library()
    if lib is None:
        return None
    try:
        from kvevents.subscribe import _zmqrecv

        names = ("msg_init", "msg_recv", "msg_data", "msg_size", "msg_more", "msg_close", "errno")
        _zmqrecv.init(
            *(ctypes.cast(getattr(lib, f"zmq_{n}"), ctypes.c_void_p).value for n in names)
        )
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    _receiver = _zmqrecv
    return _receiver


def native_receive() -> bool:
    """Whether sockets' messages are received by the C module (``_zmqrecv``) here, not pyzmq."""
    return _native_receiver() is not None


def burst_receiver_for(socket: Socket) -> Burst:
    """A function receiving the messages waiting on ``socket`` without blocking (see
    :data:`Burst`); a failure other than 'nothing waiting' raises ``zmq.ZMQError`` (pyzmq)
    or ``OSError`` (the C receiver) once no message of the burst is left to return.

    One C call per burst where ``kvevents._zmqrecv`` is built, with no objects for the topic
    and sequence frames of a batch; pyzmq otherwise. The caller keeps ``socket`` open and
    uses it from one thread.
    """
    native = _native_receiver()
    if native is None:
        return _pyzmq_burst_receiver(socket)
    burst: Burst = functools.partial(native.recv_burst, socket.underlying)
    return burst


def _pyzmq_burst_receiver(socket: Socket) -> Burst:
    recv, more = socket.recv, socket.get

    def burst(max_messages: int, max_bytes: int) -> list[Received]:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("max_messages and max_bytes must be >= 1")
        out: list[Received] = []
        size = 0
        while len(out) < max_messages and size < max_bytes:
            try:
                frames = [recv(_NOBLOCK)]
            except zmq.Again:
                break
            except zmq.ZMQError:
                if out:
                    break  # the failure recurs on the next call
                raise
            while more(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            size += sum(map(len, frames))
            if len(frames) == 3 and len(frames[1]) == 8:
                out.append((int.from_bytes(frames[1], "big"), frames[2]))
            else:
                out.append(frames)
        return out

    return burst
