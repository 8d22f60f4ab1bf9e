"""Pure frame functions for live messages, replay requests, replies and the end marker."""

from __future__ import annotations

import pytest

from kvevents import DecodeError
from kvevents.wire import (
    END_SEQ,
    live_frames,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
    unpack_seq,
)


def test_seq_is_eight_bytes_big_endian() -> None:
    """Sequence frames are unsigned 64-bit big-endian."""
    assert pack_seq(1) == b"\x00" * 7 + b"\x01"
    assert pack_seq(2**64 - 1) == b"\xff" * 8
    assert unpack_seq(b"\x00\x00\x00\x00\x00\x00\x01\x00") == 256


def test_short_seq_frame_is_an_error() -> None:
    """A sequence frame of the wrong length raises with the frame's path."""
    with pytest.raises(DecodeError) as exc:
        unpack_seq(b"\x01\x02", path="frames[1]")
    assert exc.value.path == "frames[1]"
    assert "2 bytes, expected 8" in str(exc.value)


def test_live_frames_round_trip() -> None:
    """A live message is [topic, seq, payload] and parses back."""
    frames = live_frames(b"kv", 7, b"payload")
    assert frames == [b"kv", b"\x00" * 7 + b"\x07", b"payload"]
    msg = parse_live(frames)
    assert (msg.topic, msg.seq, msg.payload) == (b"kv", 7, b"payload")


@pytest.mark.parametrize("frames", [[b"a", b"b"], [b"", pack_seq(1), b"x", b"y"]])
def test_live_message_needs_three_frames(frames: list[bytes]) -> None:
    """Anything but three frames is a malformed live message."""
    with pytest.raises(DecodeError, match="expected 3"):
        parse_live(frames)


def test_replay_request_round_trip() -> None:
    """A DEALER request is [b'', start] and the server reads the start back."""
    assert replay_request_frames(5) == [b"", pack_seq(5)]
    assert parse_replay_request(replay_request_frames(5)) == 5
    assert parse_replay_request([pack_seq(9)]) == 9


@pytest.mark.parametrize("frames", [[], [b"x", pack_seq(1)], [b"", b"\x01"], [b"", b"", b""]])
def test_malformed_replay_request(frames: list[bytes]) -> None:
    """Requests the server cannot read raise DecodeError (the server then sends the end marker)."""
    with pytest.raises(DecodeError):
        parse_replay_request(frames)


def test_four_frame_reply() -> None:
    """Current servers reply [b'', topic, seq, payload]."""
    msg = parse_replay_reply(replay_reply_frames(b"t", 3, b"p"))
    assert (msg.topic, msg.seq, msg.payload, msg.is_end) == (b"t", 3, b"p", False)


def test_three_frame_reply_from_older_servers() -> None:
    """vLLM up to 0.25 and older SGLang reply [b'', seq, payload]: seq second-to-last."""
    msg = parse_replay_reply([b"", pack_seq(4), b"p"])
    assert (msg.topic, msg.seq, msg.payload) == (None, 4, b"p")


def test_end_marker() -> None:
    """The end marker is [b'', b'', 0xFF*8, b''] and is recognised in either shape."""
    assert replay_end_frames() == [b"", b"", b"\xff" * 8, b""]
    assert parse_replay_reply(replay_end_frames()).is_end
    assert parse_replay_reply([b"", pack_seq(END_SEQ), b""]).is_end


@pytest.mark.parametrize(
    "frames", [[b"", b"x"], [b"x", b"t", pack_seq(1), b"p"], [b"", b"t", b"ab", b"p"]]
)
def test_malformed_reply(frames: list[bytes]) -> None:
    """Replies of other shapes raise DecodeError instead of being misread."""
    with pytest.raises(DecodeError):
        parse_replay_reply(frames)
