"""The GIL-keeping sender and the burst receiver behave exactly like pyzmq."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import _libzmq
from kvevents._libzmq import _pyzmq_sender, direct_library, sender_for
from kvevents.subscribe import _recv
from kvevents.subscribe._recv import _pyzmq_burst_receiver, burst_receiver_for
from kvevents.testing.sockets import Deadline, unique_inproc


@contextlib.contextmanager
def _push_pull(sndhwm: int = 1000, rcvhwm: int = 1000) -> Iterator[tuple[Any, Any]]:
    """A PUSH connected to a PULL over inproc, both closed (and their context) after."""
    ctx = zmq.Context()
    name = unique_inproc()
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, sndhwm)
    pull.setsockopt(zmq.RCVHWM, rcvhwm)
    try:
        pull.bind(name)
        push.connect(name)
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


@pytest.fixture
def big_pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """PUSH/PULL with room for every message of a test."""
    with _push_pull() as sockets:
        yield sockets


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """PUSH/PULL that hold two messages at most."""
    with _push_pull(sndhwm=2, rcvhwm=1) as sockets:
        yield sockets


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


def _receivers(sock: zmq.Socket[Any]) -> dict[str, _recv.Burst]:
    return {"chosen": burst_receiver_for(sock), "pyzmq": _pyzmq_burst_receiver(sock)}


def test_the_native_receiver_is_built_here(
    big_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    """Where the C receiver is required (CI), it is the one receiver_for picks, wired to
    pyzmq's libzmq: it receives a batch as (seq, payload)."""
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1":
        pytest.skip("KVEVENTS_REQUIRE_NATIVE is not set")
    from kvevents.subscribe import _zmqrecv

    assert _recv._native_receiver() is _zmqrecv
    push, pull = big_pair
    burst = burst_receiver_for(pull)
    assert getattr(burst, "func", None) is _zmqrecv.recv_burst
    push.send_multipart([b"", (5).to_bytes(8, "big"), b"batch"])
    got: list[Any] = []
    deadline = Deadline(5.0)
    while not got:
        assert not deadline.expired, "the message never arrived"
        got = burst(256, 1 << 20)
    assert got == [(5, b"batch")]


def test_the_native_sender_is_built_here() -> None:
    """Where the C accelerators are required (CI), the publisher's payload-lending send is
    built and wired to pyzmq's libzmq (its tests in test_publisher_send.py then run)."""
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1":
        pytest.skip("KVEVENTS_REQUIRE_NATIVE is not set")
    from kvevents.publish import _send as send
    from kvevents.publish import _zerosend

    assert send._zerosend() is _zerosend
    big = bytes(range(256)) * 256  # 64 KiB: lent to libzmq, not copied
    with _push_pull() as (push, pull):
        send3 = send.send3_for(push)
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        for seq, payload in enumerate((b"small payload", big)):
            send3(b"", seq.to_bytes(8, "big"), payload)
            assert pull.recv_multipart() == [b"", seq.to_bytes(8, "big"), payload]


@pytest.mark.parametrize("which", ["chosen", "pyzmq"])
def test_burst_returns_batches_as_pairs_and_other_shapes_as_frames(
    big_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], which: str
) -> None:
    """A live batch message (three frames, an 8-byte second) comes back as (seq, payload),
    the sequence read big-endian to 2**64 - 1; every other shape, empty and large frames
    included, as the list of its frames, in order; nothing waiting gives an empty list."""
    push, pull = big_pair
    burst = _receivers(pull)[which]
    assert burst(256, 1 << 20) == []
    big = bytes(range(256)) * 4096
    messages = [
        [b"", (7).to_bytes(8, "big"), b"payload"],
        [b"one"],
        [b"t", b"", big, b"x"],
        [b"topic", b"\xff" * 8, b""],
        [b"", b"1234567", b"seq frame one byte short"],
        [b"", b"123456789", b"one byte long"],
        [b"", (1).to_bytes(8, "big")],
        [b"a", b"b", b"c", b"d", b"e"],
    ]
    expected = [
        (7, b"payload"),
        [b"one"],
        [b"t", b"", big, b"x"],
        (2**64 - 1, b""),
        [b"", b"1234567", b"seq frame one byte short"],
        [b"", b"123456789", b"one byte long"],
        [b"", (1).to_bytes(8, "big")],
        [b"a", b"b", b"c", b"d", b"e"],
    ]
    for message in messages:
        push.send_multipart(message)
    got: list[Any] = []
    deadline = Deadline(5.0)
    while len(got) < len(messages):
        assert not deadline.expired, f"only {len(got)} messages arrived"
        got += burst(256, 1 << 30)
    assert got == expected
    assert burst(256, 1 << 20) == []


@pytest.mark.parametrize("which", ["chosen", "pyzmq"])
def test_burst_stops_at_its_message_and_byte_bounds(
    big_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], which: str
) -> None:
    """At most max_messages per call; once the frames taken reach max_bytes the burst ends
    (at least one message is taken, however large); nothing is lost between calls."""
    push, pull = big_pair
    burst = _receivers(pull)[which]
    for seq in range(10):
        push.send_multipart([b"", seq.to_bytes(8, "big"), bytes(1000)])
    push.send_multipart([b"", (10).to_bytes(8, "big"), bytes(50_000)])
    got: list[Any] = []
    deadline = Deadline(5.0)
    while not got:
        assert not deadline.expired, "nothing arrived"
        got = burst(3, 1 << 30)
    assert [seq for seq, _ in got] == [0, 1, 2]
    while len(got) < 10:  # each call takes messages until 2,500 bytes: three of 1,009
        assert not deadline.expired, "messages lost"
        more = burst(100, 2_500)
        assert 1 <= len(more) <= 3
        got += more
    while len(got) < 11:
        assert not deadline.expired, "the large message was lost"
        got += burst(100, 1)  # one message however small the bound
    assert [seq for seq, _ in got] == list(range(11))
    assert len(got[-1][1]) == 50_000
    with pytest.raises(ValueError):
        burst(0, 1)
    with pytest.raises(ValueError):
        burst(1, 0)


@pytest.mark.parametrize("which", ["chosen", "pyzmq"])
def test_receiver_failure_raises(which: str) -> None:
    """A failure other than 'nothing waiting' (here: a PUB socket cannot receive) raises."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        with pytest.raises((zmq.ZMQError, OSError)) as exc:
            _receivers(sock)[which](256, 1 << 20)
        assert exc.value.errno == zmq.ENOTSUP
    finally:
        sock.close(linger=0)
        ctx.term()


FUZZ_EXAMPLES = int(os.environ.get("KVEVENTS_FUZZ_EXAMPLES", "100"))

_frame = st.one_of(
    st.binary(max_size=40),
    st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "big")),
    st.binary(min_size=7, max_size=9),
    st.binary(min_size=1, max_size=70_000),
)


def _expected(message: list[bytes]) -> Any:
    if len(message) == 3 and len(message[1]) == 8:
        return (int.from_bytes(message[1], "big"), message[2])
    return message


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    messages=st.lists(st.lists(_frame, min_size=1, max_size=6), min_size=1, max_size=12),
    max_messages=st.integers(1, 5),
    max_bytes=st.integers(1, 100_000),
)
def test_burst_receives_any_message_shapes_like_the_reference(
    messages: list[list[bytes]], max_messages: int, max_bytes: int
) -> None:
    """Any frames, any count, any bounds: both receivers return every message once, in
    order, as the reference mapping says, each call within its bounds (fuzzed; under ASan and
    UBSan in ``make sanitize``)."""
    with _push_pull() as (push, pull):
        for message in messages:
            push.send_multipart(message)
        for which, burst in _receivers(pull).items():
            if which == "pyzmq":  # the same messages again for the second receiver
                for message in messages:
                    push.send_multipart(message)
            got: list[Any] = []
            deadline = Deadline(5.0)
            while len(got) < len(messages):
                assert not deadline.expired, f"{which}: {len(got)} of {len(messages)}"
                more = burst(max_messages, max_bytes)
                assert len(more) <= max_messages
                if len(more) > 1:  # a further message is taken only below the byte bound
                    sizes = [sum(map(len, m)) for m in messages[len(got) : len(got) + len(more)]]
                    assert sum(sizes[:-1]) < max_bytes
                got += more
            assert got == [_expected(m) for m in messages], which
            assert burst(max_messages, max_bytes) == []
