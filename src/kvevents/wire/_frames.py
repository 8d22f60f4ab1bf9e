"""Frames of live and replay messages (WIRE.md sections 2 and 3). Pure functions, no sockets.

Live message: ``[topic, seq (8 bytes, big-endian), payload]``.
Replay request (as a DEALER sends it): ``[b"", start_seq]``.
Replay reply (as a DEALER receives it): ``[b"", topic, seq, payload]`` per batch, or the
3-frame ``[b"", seq, payload]`` of older servers, then the end marker
``[b"", b"", 0xFF * 8, b""]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvevents.errors import DecodeError
from kvevents.events import KVEventBatch

__all__ = [
    "END_SEQ",
    "LiveMessage",
    "ReplayMessage",
    "encode_batch",
    "live_frames",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
    "unpack_seq",
]

#: Sequence number reserved for the end-of-replay marker; no live batch carries it.
END_SEQ = 0xFFFFFFFFFFFFFFFF
_END_SEQ_BYTES = b"\xff" * 8

_encoder = msgspec.msgpack.Encoder()


def pack_seq(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes, *, path: str = "seq") -> int:
    """Read an 8-byte big-endian sequence frame; :class:`DecodeError` for any other length."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame has {len(frame)} bytes, expected 8", path=path)
    return int.from_bytes(frame, "big")


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of a batch, exactly as the wire contract pins it."""
    return _encoder.encode(batch)


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one live message."""
    return [topic, pack_seq(seq), payload]


@dataclass(frozen=True)
class LiveMessage:
    """One live message: the topic frame, its sequence number and the raw payload."""

    topic: bytes
    seq: int
    payload: bytes


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Split a live message; exactly three frames with an 8-byte sequence."""
    if len(frames) != 3:
        raise DecodeError(f"live message has {len(frames)} frames, expected 3", path="frames")
    seq = unpack_seq(frames[1], path="frames[1]")
    return LiveMessage(topic=bytes(frames[0]), seq=seq, payload=bytes(frames[2]))


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start sequence of a request, given the frames after the ROUTER identity."""
    if len(frames) == 2 and frames[0] == b"":
        return unpack_seq(frames[1], path="request[1]")
    if len(frames) == 1:  # a client that skipped the empty delimiter
        return unpack_seq(frames[0], path="request[0]")
    raise DecodeError(
        f"replay request has {len(frames)} frames, expected [b'', seq]", path="request"
    )


def replay_reply_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as the DEALER receives it (the server prepends the identity)."""
    return [b"", topic, pack_seq(seq), payload]


def replay_end_frames() -> list[bytes]:
    """The end-of-replay marker as the DEALER receives it."""
    return [b"", b"", _END_SEQ_BYTES, b""]


@dataclass(frozen=True)
class ReplayMessage:
    """One reply message; ``topic`` is None for 3-frame servers, ``is_end`` for the marker."""

    seq: int
    payload: bytes
    topic: bytes | None

    @property
    def is_end(self) -> bool:
        """True for the end-of-replay marker."""
        return self.seq == END_SEQ


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayMessage:
    """Read a 4-frame or a legacy 3-frame reply: seq second-to-last, payload last."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise DecodeError(
            f"replay reply has {len(frames)} frames, expected [b'', topic?, seq, payload]",
            path="reply",
        )
    seq = unpack_seq(frames[-2], path=f"reply[{len(frames) - 2}]")
    topic = bytes(frames[1]) if len(frames) == 4 else None
    return ReplayMessage(seq=seq, payload=bytes(frames[-1]), topic=topic)
