"""Hypothesis strategies of the bytes the C modules read: msgpack int arrays in every width and
header form, JSON int arrays and query bodies, each cut short, extended or lying about its
length. Needs ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

import struct

from hypothesis import strategies as st

__all__ = ["codes", "ints", "json_arrays", "json_bodies", "msgpack_arrays", "msgpack_int"]


def msgpack_int(v: int, code: int) -> bytes:
    """``v`` written with the msgpack int format byte ``code`` (0xcc..0xd3), or as a fixint."""
    if code == 0 or not 0xCC <= code <= 0xD3:
        return struct.pack(">b", v) if -32 <= v < 0 else bytes([v & 0x7F])
    size = 1 << ((code - 0xCC) % 4)
    signed = code >= 0xD0
    limit = 2 ** (8 * size - (1 if signed else 0))
    low = -limit if signed else 0
    v = min(max(v, low), limit - 1)
    return bytes([code]) + v.to_bytes(size, "big", signed=signed)


#: Integers at the edges of every width.
ints = st.one_of(
    st.integers(0, 127),
    st.integers(0, 2**32 - 1),
    st.sampled_from([-1, -32, -33, 2**16, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]),
)
#: msgpack int format bytes (0: a fixint).
codes = st.sampled_from([0, *range(0xCC, 0xD4)])


@st.composite
def msgpack_arrays(draw: st.DrawFn) -> bytes:
    """Int arrays in every int width and header form, some truncated, extended or lying."""
    items = [msgpack_int(v, code) for v, code in draw(st.lists(st.tuples(ints, codes)))]
    count = len(items) + draw(st.sampled_from([0, 0, 0, 1, -1, 2**16, 2**32 - 1 - len(items)]))
    count = max(count, 0)
    header = draw(
        st.sampled_from(
            [b"\xdd" + struct.pack(">I", min(count, 2**32 - 1))]
            + ([b"\xdc" + struct.pack(">H", count)] if count < 2**16 else [])
            + ([bytes([0x90 | count])] if count < 16 else [])
        )
    )
    raw = header + b"".join(items)
    cut = draw(st.integers(0, len(raw)))
    return draw(st.sampled_from([raw, raw[:cut], raw + draw(st.binary(max_size=3))]))


@st.composite
def json_arrays(draw: st.DrawFn) -> bytes:
    """JSON int arrays (any spacing), cut short anywhere or with a tail: the scanner's edges."""
    numbers = draw(st.lists(st.one_of(ints, st.just(0)), max_size=30))
    sep = draw(st.sampled_from([b",", b", ", b" ,", b",\n"]))
    raw = b"[" + sep.join(b"%d" % n for n in numbers) + b"]"
    cut = draw(st.integers(0, len(raw)))
    tail = draw(st.sampled_from([b"", b" ", b"\t\n", b"x", b"]"]))
    return draw(st.sampled_from([raw, raw[:cut], raw[:cut] + tail, raw + tail]))


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    """Query-like objects cut short anywhere: the member scan must stop at the end."""
    tokens = draw(json_arrays())
    before = draw(st.sampled_from([b"", b'"model": "m", ', b'"a": [1, {"b": "]"}], ']))
    raw = b"{" + before + b'"token_ids": ' + tokens + b"}"
    return raw[: draw(st.integers(0, len(raw)))]
