"""The engine thread's send of a batch's three frames into the publisher's queue.

Where ``kvevents.publish._zerosend`` is built and the libzmq pyzmq loaded is found, the three
frames go in one C call (GIL kept), and a payload of :data:`MIN_BORROW` bytes or more, below
:data:`MAX_BORROW`, is lent to libzmq instead of copied: the copy of a 28 KiB prefill into a
fresh message was a malloc and several page faults on the engine's thread. Otherwise
:func:`kvevents._libzmq.sender_for` sends (copying). ``KVEVENTS_ZERO_COPY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import zmq

from kvevents._libzmq import Send3, Socket, direct_library, sender_for

__all__ = ["MAX_BORROW", "MIN_BORROW", "lent_payloads", "release_payloads", "send3_for"]

#: Payloads this large or larger are lent; below it a copy is cheaper than the bookkeeping.
MIN_BORROW = 8192
#: Payloads this large or larger are copied again. glibc serves allocations of 128 KiB and up
#: with fresh pages; a lent one lives until libzmq lets go of it, so each new payload faulted
#: in all its pages (57 faults for 230 KiB, against 39 when copied): measured slower.
MAX_BORROW = 128 * 1024
_NEVER = 2**62
_native: Any = None  # our C extension, which has no type stubs
_searched = False


def _zerosend() -> Any:  # our C extension, which has no type stubs
    """``kvevents.publish._zerosend`` wired to pyzmq's libzmq, or None when unavailable."""
    global _native, _searched
    if _searched:
        return _native
    _searched = True
    lib = direct_library()
    if lib is None or os.environ.get("KVEVENTS_ZERO_COPY", "1") == "0":
        return None
    try:
        from kvevents.publish import _zerosend

        names = ("msg_init_data", "msg_send", "msg_close", "send", "errno")
        _zerosend.init(
            *(ctypes.cast(getattr(lib, f"zmq_{n}"), ctypes.c_void_p).value for n in names)
        )
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    _native = _zerosend
    return _native


def send3_for(socket: Socket) -> Send3:
    """A function sending three frames non-blocking on ``socket`` (as ``sender_for``'s)."""
    native = _zerosend()
    if native is None:
        return sender_for(socket)
    send = functools.partial(native.send3, socket.underlying)

    def send3(topic: bytes, seq: bytes, payload: bytes) -> None:
        err = send(topic, seq, payload, MIN_BORROW if len(payload) < MAX_BORROW else _NEVER)
        if err:
            raise zmq.Again() if err == zmq.EAGAIN else zmq.ZMQError(err)

    return send3


def release_payloads() -> int:
    """Drop the payloads libzmq has let go of (each send does it too); how many."""
    native = _zerosend()
    return int(native.release()) if native is not None else 0


def lent_payloads() -> int:
    """Payloads lent to libzmq and not released yet (0 without lending)."""
    native = _zerosend()
    return int(native.outstanding()) if native is not None else 0
