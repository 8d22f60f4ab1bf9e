"""The JSON scanners of HTTP bodies (``kvevents.http._jsonscan``, C) against their reference
(``kvevents.http._scan_py``): the same answers on hand-picked and random JSON, and no read past
the end of a buffer (each input is also placed flush against an unreadable page; ``make
sanitize`` runs this file again under ASan and UBSan, with more examples).
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.http import _scan, _scan_py
from test_index_native import guarded, json_arrays, json_bodies

try:
    from kvevents.http import _jsonscan

    c_impl: ModuleType | None = _jsonscan
    C_MISSING = ""
except ImportError as exc:  # pragma: no cover
    c_impl = None
    C_MISSING = f"the C extension kvevents.http._jsonscan is not usable: {exc}"

needs_c = pytest.mark.skipif(c_impl is None, reason=C_MISSING or "C extension available")
IMPLS = [
    pytest.param(_scan_py, id="python"),
    pytest.param(c_impl, id="c", marks=needs_c),
]
#: Examples per fuzz test; the sanitizer job raises it.
FUZZ_EXAMPLES = int(os.environ.get("KVEVENTS_FUZZ_EXAMPLES", "200"))
EXAMPLES = 60 if os.environ.get("CI") else 150


def c() -> ModuleType:
    assert c_impl is not None
    return c_impl


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc))


def agree(call: Callable[[ModuleType, Any], Any], data: bytes) -> None:
    """The C call on ``data`` (as bytes, and flush against a guard page) equals the reference's."""
    want = _outcome(lambda: call(_scan_py, data))
    assert _outcome(lambda: call(c(), data)) == want
    with guarded() as page:
        view = page.at_end(data)
        try:
            got = _outcome(lambda: call(c(), view))
        finally:
            view.release()  # before the page is unmapped
        assert got == want


# ------------------------------------------------------------------ hand-picked

EDGE_JSON = [
    b"[]",
    b" \t\n[ \r\n] \n",
    b"[0]",
    b"[-0]",
    b"[4294967295]",
    b"[4294967296]",
    b"[99999999999999999999999]",
    b"[1,2 , 3]",
    b"[[1]]",
    b"[1.0]",
    b"[1e2]",
    b"[1E2]",
    b"[-1]",
    b"[+1]",
    b"[01]",
    b"[-01]",
    b"[1,]",
    b"[,1]",
    b"[,]",
    b"[1 2]",
    b"[1]x",
    b"[1] [2]",
    b"",
    b"[",
    b"[1",
    b"1",
    b'["1"]',
    b"[true]",
    b"[null]",
    b"{}",
    b"\xef\xbb\xbf[1]",
    b"[\x0c1]",
    b"[-]",
    b"[1.]",
    b"[NaN]",
]
# The C parser's fast path takes 1-8 digits followed by a separator: the lengths around it, the
# separators and the ", " layout, in arrays long enough to use it.
_PAD = b", ".join(b"%d" % n for n in range(1, 12))
_AROUND_THE_FAST_PATH = [b"12345678", b"123456789", b"1234567890", b"4294967295", b"4294967296"]
_AROUND_THE_FAST_PATH += [b"99999999999", b"0", b"00", b"01", b"-0", b"-1", b"1.0", b"1e3"]
_AROUND_THE_FAST_PATH += [b"12345678.5"]
EDGE_JSON += [
    b"[" + _PAD + b", " + number + tail + b"]"
    for number in _AROUND_THE_FAST_PATH
    for tail in (b"", b", 7", b" ,7", b",7", b" ")
]


@pytest.mark.parametrize("raw", EDGE_JSON)
def test_pack_json_edge_cases(raw: bytes) -> None:
    """Hand-picked valid and invalid JSON: the C parser answers as the reference does."""
    want = _scan_py.pack_json_tokens(raw)
    if c_impl is None:
        pytest.skip(C_MISSING)
    assert c().pack_json_tokens(raw) == want
    assert c().pack_json_tokens(msgspec.Raw(raw)) == want
    assert c().pack_json_tokens(raw.decode("utf-8", "replace")) == _scan_py.pack_json_tokens(
        raw.decode("utf-8", "replace")
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_huge_arrays(impl: ModuleType) -> None:
    """100k tokens in JSON pack to the same little-endian bytes; one out of range: None."""
    tokens = [random.Random(1).getrandbits(32) for _ in range(100_000)]
    want = struct.pack(f"<{len(tokens)}I", *tokens)
    assert impl.pack_json_tokens(msgspec.json.encode(tokens)) == want
    assert impl.pack_json_tokens(msgspec.json.encode([*tokens, -1])) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_json_member_reads_the_first_top_level_member(impl: ModuleType) -> None:
    """The first top-level member with that exact key, with its span; None otherwise."""
    body = b'{"a": {"token_ids": [9]}, "s": "token_ids\\"]", "token_ids": [1, 2], "b": 1}'
    found = impl.pack_json_member(body, b"token_ids")
    assert found is not None
    packed, start, end = found
    assert packed == struct.pack("<2I", 1, 2) and body[start:end] == b"[1, 2]"
    for bad in (
        b'{"token_ids": [[1]]}',
        b'{"token_ids": "[1]"}',
        b'{"token_ids": [1, 2.5]}',
        b'{"tok\\u0065n_ids": [1]}',
        b"[1]",
        b'{"other": [1]}',
    ):
        assert impl.pack_json_member(bad, b"token_ids") is None, bad
    # The rest of the body is the caller's to validate: an unclosed object still yields.
    assert impl.pack_json_member(b'{"token_ids": [1] ', b"token_ids") is not None


@needs_c
def test_the_c_functions_take_their_arguments_by_position_only() -> None:
    """A wrong number of arguments, or a keyword, is a TypeError naming the function."""
    with pytest.raises(TypeError, match="pack_json_member"):
        c().pack_json_member(b"{}")
    with pytest.raises(TypeError):
        c().pack_json_member(b"{}", key=b"k")
    with pytest.raises(TypeError):
        c().pack_json_tokens(raw=b"[]")


# ------------------------------------------------------------------ random JSON

token_values = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 200),
    st.sampled_from([2**32, 2**32 - 1, -1, -32, -33, 2**63, 2**64 - 1]),
)
json_values = st.recursive(
    st.one_of(
        token_values,
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        st.none(),
        st.text(max_size=3),
    ),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=10,
)
_gaps = st.text(alphabet=" \t\r\n", max_size=2)


@st.composite
def json_texts(draw: st.DrawFn) -> bytes:
    """Token arrays and nested values, any spacing, some with a one-character edit."""
    value = draw(st.one_of(st.lists(token_values, max_size=12), st.lists(json_values, max_size=4)))
    text = json.dumps(value, separators=(draw(_gaps) + "," + draw(_gaps), ":"))
    text = draw(_gaps) + text + draw(_gaps)
    edit = draw(st.sampled_from(["none", "none", "drop", "insert"]))
    if edit != "none" and text:
        at = draw(st.integers(0, len(text) - 1))
        extra = draw(st.sampled_from(["-", "+", "0", ".", "e", ",", "]", "[", " ", "1"]))
        text = text[:at] + (extra if edit == "insert" else "") + text[at + 1 :]
    return text.encode()


@needs_c
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(json_texts())
def test_pack_json_matches_reference(raw: bytes) -> None:
    """Random JSON (token arrays, nested values, floats, one-character edits) agrees."""
    assert c().pack_json_tokens(raw) == _scan_py.pack_json_tokens(raw)


@st.composite
def json_objects(draw: st.DrawFn) -> bytes:
    """Query-like JSON objects: token_ids first, last, nested, repeated, absent or odd."""
    members = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["token_ids", "model_name", "policy", "tok\\u0065n", "x"]),
                st.one_of(st.lists(token_values, max_size=12), json_values),
            ),
            max_size=4,
        )
    )
    parts = [
        json.dumps(name) + draw(_gaps) + ":" + draw(_gaps) + json.dumps(value)
        for name, value in members
    ]
    text = draw(_gaps) + "{" + draw(_gaps) + ("," + draw(_gaps)).join(parts) + draw(_gaps) + "}"
    edit = draw(st.sampled_from(["none", "none", "none", "drop", "insert"]))
    if edit != "none":
        at = draw(st.integers(0, len(text) - 1))
        extra = draw(st.sampled_from(["]", "[", '"', "\\", ",", ":", "{", "}", " ", "1"]))
        text = text[:at] + (extra if edit == "insert" else "") + text[at + 1 :]
    return text.encode()


@needs_c
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(json_objects())
def test_pack_json_member_matches_reference(body: bytes) -> None:
    """The member scan agrees with the reference on random objects and one-character edits."""
    want = _scan_py.pack_json_member(body, b"token_ids")
    assert c().pack_json_member(body, b"token_ids") == want


# ------------------------------------------------------------------ the edge of memory


@needs_c
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.one_of(json_arrays(), st.binary(max_size=64)))
def test_pack_json_tokens_fuzzed(raw: bytes) -> None:
    """Any JSON-ish bytes: the reference's answer, and no read past the end."""
    agree(lambda impl, data: impl.pack_json_tokens(data), raw)


@needs_c
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.one_of(json_bodies(), st.binary(max_size=64)))
def test_pack_json_member_fuzzed(body: bytes) -> None:
    """Any body, cut anywhere: the reference's answer, and no read past its end."""
    agree(lambda impl, data: impl.pack_json_member(data, b"token_ids"), body)


@needs_c
def test_json_array_open_at_the_end_of_memory() -> None:
    """'[' then nothing (or blanks) up to the end of the buffer: the packer stops there.

    It used to read the byte after the buffer (seen under ASan; a crash at a guard page)."""
    for raw in [b"[", b"[ ", b"[\n\t ", b"[1,", b"[1, ", b"[12345678", b"[1, 2, 3, 4, 5, 6"]:
        agree(lambda impl, data: impl.pack_json_tokens(data), raw)
        agree(lambda impl, data: impl.pack_json_member(data, b"t"), b'{"t": ' + raw)


# ------------------------------------------------------------------ selection


def test_selector_picks_c_when_required() -> None:
    """With KVEVENTS_REQUIRE_NATIVE=1 (CI) the selector must have picked the C extension."""
    if os.environ.get("KVEVENTS_PURE_PYTHON") == "1":
        pytest.skip("KVEVENTS_PURE_PYTHON=1: the fallback is under test")
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1" and _scan.IMPLEMENTATION != "c":
        pytest.skip(f"the pure-Python JSON scanner is in use: {_scan.FALLBACK_REASON}")
    assert _scan.IMPLEMENTATION == "c", _scan.FALLBACK_REASON
    assert _scan.pack_json_member is c().pack_json_member


def test_selector_honours_pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVEVENTS_PURE_PYTHON=1 selects the reference and says so."""
    monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "1")
    impl, reason = _scan._select()
    assert impl is _scan_py and impl.IMPLEMENTATION == "python"
    assert reason == "KVEVENTS_PURE_PYTHON=1"
