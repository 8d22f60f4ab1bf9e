"""Direct calls into the libzmq pyzmq loaded: multipart sends that keep the GIL.

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
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import zmq

__all__ = ["Context", "Send3", "Socket", "direct_library", "sender_for"]

# pyzmq's Socket is generic over what its send and recv calls return (the value itself for a
# blocking socket, an awaitable under zmq.asyncio), and zmq.Context() makes Socket[Any]: the
# package's sockets are all blocking ones, named once here.
Socket: TypeAlias = zmq.Socket[Any]
Context: TypeAlias = zmq.Context[Any]  # the same, for the context that makes those sockets

Send3 = Callable[[bytes, bytes, bytes], None]
_FLAGS_MORE = zmq.SNDMORE | zmq.NOBLOCK
_FLAGS_LAST = zmq.NOBLOCK
_library: Any = None  # ctypes.PyDLL: its functions are untyped
_searched = False


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


def direct_library() -> Any:  # ctypes.PyDLL: its functions are untyped
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


def sender_for(socket: Socket) -> Send3:
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


def _pyzmq_sender(socket: Socket) -> Send3:
    def send3(a: bytes, b: bytes, c: bytes) -> None:
        socket.send(a, _FLAGS_MORE)
        socket.send(b, _FLAGS_MORE)
        socket.send(c, _FLAGS_LAST)

    return send3
