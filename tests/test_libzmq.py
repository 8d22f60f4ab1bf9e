"""The GIL-keeping sender and the one-call receiver behave exactly like pyzmq."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvevents import _libzmq
from kvevents._libzmq import _pyzmq_sender, direct_library, sender_for
from kvevents.subscribe import _recv
from kvevents.subscribe._recv import _pyzmq_receiver, receiver_for
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
    if _libzmq._mapped_libzmq() is None:
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


def _receivers(sock: zmq.Socket[Any]) -> dict[str, _recv.Recv]:
    return {"chosen": receiver_for(sock), "pyzmq": _pyzmq_receiver(sock)}


def test_the_native_receiver_is_built_here() -> None:
    """Where the C receiver is required (CI), it is the one receiver_for picks."""
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1":
        pytest.skip("KVEVENTS_REQUIRE_NATIVE is not set")
    assert _recv._native_receiver() is not None


def test_the_native_sender_is_built_here() -> None:
    """Where the C accelerators are required (CI), the publisher's payload-lending send is
    built and wired to pyzmq's libzmq (its tests in test_publisher_send.py then run)."""
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1":
        pytest.skip("KVEVENTS_REQUIRE_NATIVE is not set")
    from kvevents.publish import send

    assert send._zerosend() is not None


@pytest.mark.parametrize("which", ["chosen", "pyzmq"])
def test_receiver_returns_whole_messages_then_none(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], which: str
) -> None:
    """Every frame of each message, in order, empty and large frames included; None when
    nothing is waiting."""
    push, pull = pair
    recv = _receivers(pull)[which]
    assert recv() is None
    big = bytes(range(256)) * 4096
    messages = [[b"", (7).to_bytes(8, "big"), b"payload"], [b"one"], [b"t", b"", big, b"x"]]
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    for message in messages:
        push.send_multipart(message)
        assert poller.poll(5000), "message not delivered"
        assert recv() == message
    assert recv() is None


@pytest.mark.parametrize("which", ["chosen", "pyzmq"])
def test_receiver_failure_raises(which: str) -> None:
    """A failure other than 'nothing waiting' (here: a PUB socket cannot receive) raises."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        with pytest.raises((zmq.ZMQError, OSError)) as exc:
            _receivers(sock)[which]()
        assert exc.value.errno == zmq.ENOTSUP
    finally:
        sock.close(linger=0)
        ctx.term()
