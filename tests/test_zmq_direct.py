"""The GIL-keeping sender behaves exactly like pyzmq's sends."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvevents import _zmq_direct
from kvevents._zmq_direct import _pyzmq_sender, direct_library, sender_for
from kvevents.testing.sockets import unique_inproc


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    name = unique_inproc()
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 2)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.bind(name)
    push.connect(name)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="library lookup uses /proc")
def test_pyzmq_libzmq_is_found_on_linux() -> None:
    """On Linux with a pyzmq wheel, the mapped libzmq is loaded as a GIL-keeping PyDLL."""
    if _zmq_direct._mapped_libzmq() is None:
        pytest.skip("this pyzmq links libzmq statically")
    assert isinstance(direct_library(), ctypes.PyDLL)


@pytest.mark.parametrize("direct", [True, False])
def test_three_frames_then_again_when_full(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], direct: bool
) -> None:
    """Frames arrive as one message; a full pipe raises zmq.Again and sends nothing."""
    push, pull = pair
    send3 = sender_for(push) if direct else _pyzmq_sender(push)
    sent = 0
    with pytest.raises(zmq.Again):
        for i in range(100):
            send3(b"topic", i.to_bytes(8, "big"), b"payload")
            sent += 1
    assert 1 <= sent < 100
    got = []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while len(got) < sent and poller.poll(5000):
        got.append(pull.recv_multipart())
    assert got == [[b"topic", i.to_bytes(8, "big"), b"payload"] for i in range(sent)]
    assert poller.poll(0) == []  # the refused message left nothing behind


def test_closed_socket_raises_zmq_error() -> None:
    """The fallback sender surfaces a closed socket as ZMQError (the publisher counts it)."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(unique_inproc())
    send3 = _pyzmq_sender(push)
    push.close()
    with pytest.raises(zmq.ZMQError):
        send3(b"a", b"b", b"c")
    ctx.term()
