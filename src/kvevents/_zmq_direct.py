"""Multipart sends that keep the GIL, for the engine's hot path.

pyzmq releases the GIL around every ``zmq_msg_send``. For a non-blocking send into an inproc
pipe that takes a microsecond, the release is pure cost: when another thread of the engine is
busy, getting the GIL back waits for that thread's switch interval (5 ms by default), once per
frame. Measured with a CPU-burning thread: p99 of a 3-frame send 5.1 ms through pyzmq,
0.03 ms by calling libzmq's ``zmq_send`` through :class:`ctypes.PyDLL`, which does not
release the GIL (and 2.3 µs instead of 3.2 µs when idle).

This is only safe with the *same* libzmq instance pyzmq uses, so the library is located
through the files this process has mapped; when it cannot be found (another platform, a
static build), :func:`sender_for` falls back to pyzmq. ``KVEVENTS_DIRECT_SEND=0`` disables it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

__all__ = ["Recv", "Send3", "direct_library", "receiver_for", "sender_for"]

Send3 = Callable[[bytes, bytes, bytes], None]
Recv = Callable[[], list[bytes] | None]
_FLAGS_MORE = zmq.SNDMORE | zmq.NOBLOCK
_FLAGS_LAST = zmq.NOBLOCK
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_library: Any = None
_searched = False
_receiver: Any = None
_receiver_searched = False


def _mapped_libzmq() -> str | None:
    """The path of the libzmq this process has loaded (Linux), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if os.path.basename(path).startswith("libzmq") and ".so" in path:
            return path
    return None


def direct_library() -> Any:
    """libzmq as a ``ctypes.PyDLL`` (GIL kept during calls), or None when unavailable."""
    global _library, _searched
    if _searched:
        return _library
    _searched = True
    if os.environ.get("KVEVENTS_DIRECT_SEND", "1") == "0":
        return None
    path = _mapped_libzmq()
    if path is None:
        return None
    try:
        lib = ctypes.PyDLL(path)
        lib.zmq_send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
        lib.zmq_send.restype = ctypes.c_int
        lib.zmq_errno.restype = ctypes.c_int
        version = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int())
        lib.zmq_version(*(ctypes.byref(v) for v in version))
    except (OSError, AttributeError):
        return None
    if tuple(v.value for v in version) != zmq.zmq_version_info():
        return None  # not the library pyzmq was built against
    _library = lib
    return lib


def sender_for(socket: zmq.Socket[Any]) -> Send3:
    """A function sending three frames non-blocking on ``socket``.

    Raises ``zmq.Again`` when the first frame would block (nothing is sent: libzmq accepts a
    multipart message whole or not at all), ``zmq.ZMQError`` on other failures. The caller
    serialises calls and keeps ``socket`` open while the function is in use.
    """
    lib = direct_library()
    if lib is None:
        return _pyzmq_sender(socket)
    send, errno, handle = lib.zmq_send, lib.zmq_errno, socket.underlying

    def send3(a: bytes, b: bytes, c: bytes) -> None:
        if send(handle, a, len(a), _FLAGS_MORE) < 0:
            code = errno()
            raise zmq.Again() if code == zmq.EAGAIN else zmq.ZMQError(code)
        if send(handle, b, len(b), _FLAGS_MORE) < 0 or send(handle, c, len(c), _FLAGS_LAST) < 0:
            raise zmq.ZMQError(errno())

    return send3


def _pyzmq_sender(socket: zmq.Socket[Any]) -> Send3:
    def send3(a: bytes, b: bytes, c: bytes) -> None:
        socket.send(a, _FLAGS_MORE)
        socket.send(b, _FLAGS_MORE)
        socket.send(c, _FLAGS_LAST)

    return send3


def _native_receiver() -> Any:
    """``kvevents._zmqrecv`` wired to the libzmq pyzmq loaded, or None when unavailable."""
    global _receiver, _receiver_searched
    if _receiver_searched:
        return _receiver
    _receiver_searched = True
    lib = direct_library()
    if lib is None:
        return None
    try:
        from . import _zmqrecv

        names = ("msg_init", "msg_recv", "msg_data", "msg_size", "msg_more", "msg_close", "errno")
        _zmqrecv.init(
            *(ctypes.cast(getattr(lib, f"zmq_{n}"), ctypes.c_void_p).value for n in names)
        )
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    _receiver = _zmqrecv
    return _receiver


def receiver_for(socket: zmq.Socket[Any]) -> Recv:
    """A function receiving the next whole message on ``socket`` without blocking: its
    frames, or None when nothing is waiting (``zmq.ZMQError``, or ``OSError`` from the C
    receiver, on other failures).

    One C call per message where ``kvevents._zmqrecv`` is built (about 4x cheaper than
    pyzmq's per-frame calls); pyzmq otherwise. The caller keeps ``socket`` open and uses it
    from one thread.
    """
    native = _native_receiver()
    if native is None:
        return _pyzmq_receiver(socket)
    receive: Recv = functools.partial(native.recv, socket.underlying)
    return receive


def _pyzmq_receiver(socket: zmq.Socket[Any]) -> Recv:
    recv, more = socket.recv, socket.get

    def receive() -> list[bytes] | None:
        try:
            frames = [recv(_NOBLOCK)]
        except zmq.Again:
            return None
        while more(_RCVMORE):
            frames.append(recv(_NOBLOCK))
        return frames

    return receive
