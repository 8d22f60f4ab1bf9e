"""The C table primitives against their plain-Python reference: same results, same tables.

The reference is a dict; the C map keys 64-bit patterns and checks ranges. They agree on what
an index gives them: ints in range, the keys of one map all signed or all unsigned (one engine
writes its hashes one way). The C map's own edge cases (a negative key and its unsigned value
being one key, range and type errors) are tested on the C map alone.
"""

from __future__ import annotations

import os
import random
import struct
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index import _table_py as py_impl
from kvevents.index import table as blocktable

try:
    c_impl: ModuleType | None = blocktable._load_native()
    C_MISSING = ""
except (ImportError, OSError, AttributeError, ValueError) as exc:  # pragma: no cover
    c_impl = None
    C_MISSING = f"the C extension kvevents.index._blocktable is not usable: {exc}"

needs_c = pytest.mark.skipif(c_impl is None, reason=C_MISSING or "C extension available")
IMPLS = [
    pytest.param(py_impl, id="python"),
    pytest.param(c_impl, id="c", marks=needs_c),
]
EXAMPLES = 60 if os.environ.get("CI") else 150

U64 = 2**64
EDGE_KEYS = [0, 1, 2**63 - 1, 2**63, U64 - 1, -1, -(2**63)]
BAD_KEYS = [U64, -(2**63) - 1, 2**70]
#: Keys of one map, in one of the two forms an engine writes: signed or unsigned 64-bit.
KEY_FORMS = {
    "signed": st.one_of(
        st.sampled_from([0, 1, 2**63 - 1, -1, -(2**63)]),
        st.integers(0, 40),
        st.integers(-(2**63), 2**63 - 1),
    ),
    "unsigned": st.one_of(
        st.sampled_from([0, 1, 2**63, U64 - 1]), st.integers(0, 40), st.integers(0, U64 - 1)
    ),
}
values = st.one_of(st.integers(0, U64 - 1), st.sampled_from([0, U64 - 1]))


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did: its result, or the type of the exception it raised."""
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc))


def c() -> ModuleType:
    assert c_impl is not None
    return c_impl


# ------------------------------------------------------------------ U64Map


def map_ops(keys: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.one_of(
        st.tuples(st.just("set"), keys, values),
        st.tuples(st.sampled_from(["get", "get_default", "pop", "pop_default", "del"]), keys),
        st.tuples(st.sampled_from(["contains", "getitem"]), keys),
        st.tuples(st.sampled_from(["clear", "keys", "items", "values", "iter", "len"])),
    )


map_runs = st.sampled_from(sorted(KEY_FORMS)).flatmap(
    lambda form: st.lists(map_ops(KEY_FORMS[form]), max_size=60)
)


def apply_map_op(m: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    name = op[0]
    calls: dict[str, Callable[[], Any]] = {
        "set": lambda: m.__setitem__(op[1], op[2]),
        "get": lambda: m.get(op[1]),
        "get_default": lambda: m.get(op[1], "missing"),
        "pop": lambda: m.pop(op[1]),
        "pop_default": lambda: m.pop(op[1], "missing"),
        "del": lambda: m.__delitem__(op[1]),
        "contains": lambda: op[1] in m,
        "getitem": lambda: m[op[1]],
        "clear": m.clear,
        "keys": lambda: sorted(m.keys()),
        "items": lambda: sorted(m.items()),
        "values": lambda: Counter(m.values()),
        "iter": lambda: sorted(m),
        "len": lambda: len(m),
    }
    return outcome(calls[name])


@needs_c
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(map_runs)
def test_map_matches_reference(ops: list[tuple[Any, ...]]) -> None:
    """Every map operation gives the reference's result or exception type, edge keys included."""
    ours, ref = c().U64Map(), py_impl.U64Map()
    for op in ops:
        assert apply_map_op(ours, op) == apply_map_op(ref, op), op
    assert sorted(ours.items()) == sorted(ref.items())


@needs_c
def test_map_edge_keys() -> None:
    """All 2**64 patterns are C keys; a negative key and its unsigned value are the same key."""
    m = c().U64Map()
    for k in [0, 1, 2**63, U64 - 1]:
        m[k] = k
    assert sorted(m.keys()) == [0, 1, 2**63, U64 - 1]
    assert m[-1] == U64 - 1 and -(2**63) in m
    m[-1] = 5  # the same key as 2**64 - 1: keys now read back signed
    assert len(m) == 4
    assert sorted(m.items()) == [(-(2**63), 2**63), (-1, 5), (0, 0), (1, 1)]
    assert m.pop(0) == 0 and 0 not in m and m.get(0) is None
    with pytest.raises(OverflowError):
        m[U64] = 1
    with pytest.raises(OverflowError):
        m[1] = -1
    with pytest.raises(TypeError):
        m["1"] = 1
    with pytest.raises(KeyError):
        del m[12345]
    with pytest.raises(KeyError):
        m.pop(12345)
    for bad in BAD_KEYS:
        with pytest.raises(OverflowError):
            m[bad] = 1


@pytest.mark.parametrize("impl", IMPLS)
def test_map_keys_values_and_items_agree_in_order(impl: ModuleType) -> None:
    """keys(), values(), items() and iteration list the entries in one order (zero key too)."""
    m = impl.U64Map()
    for k in [5, 0, 2**64 - 1, 77, 2**40]:
        m[k] = k % 1000 + 1
    assert list(zip(m.keys(), m.values(), strict=True)) == list(m.items())
    assert list(m) == list(m.keys()) and len(m.items()) == 5


@pytest.mark.parametrize("impl", IMPLS)
def test_map_listings_are_copies(impl: ModuleType) -> None:
    """keys(), values() and items() are lists copied at the call (read after a lock is let go)."""
    m = impl.U64Map()
    m[1], m[3] = 2, 4
    keys, values, items = m.keys(), m.values(), m.items()
    m[5] = 6
    del m[1]
    assert type(keys) is type(values) is type(items) is list
    assert (sorted(keys), sorted(values), sorted(items)) == ([1, 3], [2, 4], [(1, 2), (3, 4)])
    assert len(items[:1]) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_map_grows_and_shrinks_like_a_dict(impl: ModuleType) -> None:
    """Many inserts and deletes (sequential and random keys) leave exactly a dict's contents."""
    rng = random.Random(7)
    m, want = impl.U64Map(), {}
    keys = list(range(20_000)) + [rng.getrandbits(64) for _ in range(20_000)]
    for k in keys:
        m[k] = k & 0xFFFF
        want[k] = k & 0xFFFF
    rng.shuffle(keys)
    for k in keys[: len(keys) * 3 // 4]:
        del m[k]
        del want[k]
    assert len(m) == len(want)
    assert sorted(m.items()) == sorted(want.items())
    assert all(m[k] == v for k, v in want.items())
    for k in keys[len(keys) * 3 // 4 :]:
        assert m.pop(k) == want.pop(k)
    assert len(m) == 0 and list(m.items()) == []


@needs_c
def test_map_nbytes_follows_capacity() -> None:
    """nbytes grows with the table, falls back when entries go, and clear() frees to the minimum."""
    m = c().U64Map()
    empty = m.nbytes
    seen = [empty]
    for k in range(1, 5000):
        m[k] = k
        seen.append(m.nbytes)
    assert seen == sorted(seen) and seen[-1] > empty
    for k in range(1, 5000):
        del m[k]
    assert m.nbytes < seen[-1] // 8
    for k in range(1000):
        m[k] = k
    m.clear()
    assert m.nbytes == empty and len(m) == 0


@needs_c
def test_map_bytes_per_entry_at_a_million() -> None:
    """A million entries cost at most ~38 bytes each (16-byte slots, load >= 0.4)."""
    m = c().U64Map()
    for k in range(1_000_000):
        m[k * 0x9E3779B97F4A7C15 % U64] = k
    assert len(m) == 1_000_000
    assert m.nbytes / 1_000_000 <= 24 * 1.6


@needs_c
def test_no_reference_leaks() -> None:
    """Defaults, unknown hashes and shared hashes returned by the C code keep their counts."""
    impl = c()
    m, default = impl.U64Map(), object()
    big = 2**62 + 12345  # not a cached small int
    hashes = [big, big + 1]
    before = (sys.getrefcount(default), sys.getrefcount(big), sys.getrefcount(hashes))
    for _ in range(1000):
        m.get(7, default)
        m.pop(7, default)
        impl.remove_blocks(impl.U64Map(), m, impl.U64Map(), 1, hashes)
        impl.walk(m, hashes, 1)
    blocks, engine = impl.U64Map(), impl.U64Map()
    impl.store_chain(blocks, engine, 1, [1], [big])
    for i in range(1000):
        assert impl.store_chain(blocks, engine, 1, [i + 2], [big]) == [big]
    after = (sys.getrefcount(default), sys.getrefcount(big), sys.getrefcount(hashes))
    assert after == before


@needs_c
def test_functions_require_maps() -> None:
    """The C functions take U64Map tables, nothing else."""
    impl = c()
    with pytest.raises(TypeError):
        impl.walk({}, [1], 1)
    with pytest.raises(TypeError):
        impl.store_chain(impl.U64Map(), {}, 1, [1], [2])
    with pytest.raises(TypeError):
        impl.U64Map(1)


# ------------------------------------------------------------------ block functions

HOLDERS = 4
#: Engine hashes of one run, all in one form (see the module docstring).
ENGINE_FORMS = {
    "signed": st.one_of(st.integers(0, 30), st.sampled_from([-1, -5, 0])),
    "unsigned": st.one_of(st.integers(0, 30), st.sampled_from([U64 - 1, U64 - 5, 0])),
}
our_hashes = st.integers(0, 10)
walked = st.lists(st.integers(0, 6), max_size=8)  # a narrower range: more prefixes match


def index_ops(engine_hashes: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.one_of(
        st.tuples(
            st.just("store"),
            st.integers(0, HOLDERS - 1),
            st.lists(st.tuples(engine_hashes, our_hashes), max_size=8),
        ),
        st.tuples(
            st.just("store_run"),
            st.integers(0, HOLDERS - 1),
            st.lists(engine_hashes, max_size=6),
            st.integers(1, 3),  # block size
            st.integers(0, 3),  # token pattern: few patterns, so runs share blocks
            st.sampled_from([0, 5, U64 - 1]),  # seed
            st.integers(-1, 1),  # tokens short by a block, exact, one block too many
        ),
        st.tuples(
            st.just("remove"), st.integers(0, HOLDERS - 1), st.lists(engine_hashes, max_size=8)
        ),
        st.tuples(st.just("drop"), st.integers(0, HOLDERS - 1)),
        st.tuples(st.just("walk"), walked, st.integers(0, 2**HOLDERS - 1), st.booleans()),
        st.tuples(
            st.just("extend"),
            walked,
            st.integers(-10, 10),
            st.integers(0, 2**HOLDERS - 1),
        ),
    )


index_runs = st.sampled_from(sorted(ENGINE_FORMS)).flatmap(
    lambda form: st.lists(index_ops(ENGINE_FORMS[form]), max_size=40)
)


def run_tokens(pattern: int, blocks: int, block_size: int) -> bytes:
    """Packed tokens of a run: ``pattern`` picks the ids, so two runs may share blocks."""
    return struct.pack(f"<{blocks * block_size}I", *[pattern] * (blocks * block_size))


class Tables:
    """The maps of a small index: blocks, each holder's engine map, and tombstones."""

    def __init__(self, impl: ModuleType) -> None:
        self.impl = impl
        self.blocks = impl.U64Map()
        self.engines = [impl.U64Map() for _ in range(HOLDERS)]
        self.tombs = impl.U64Map()

    def apply(self, op: tuple[Any, ...]) -> tuple[str, Any]:
        impl, name = self.impl, op[0]
        if name == "store":
            pairs = op[2]
            return outcome(
                lambda: impl.store_chain(
                    self.blocks,
                    self.engines[op[1]],
                    1 << op[1],
                    [eh for eh, _ in pairs],
                    tuple(oh for _, oh in pairs),
                )
            )
        if name == "store_run":
            _, holder, hashes, size, pattern, seed, extra = op
            packed = run_tokens(pattern, max(0, len(hashes) + extra), size)
            return outcome(
                lambda: impl.store_run(
                    self.blocks, self.engines[holder], 1 << holder, hashes, packed, size, seed
                )
            )
        if name == "remove":
            return outcome(
                lambda: impl.remove_blocks(
                    self.blocks, self.engines[op[1]], self.tombs, 1 << op[1], op[2]
                )
            )
        if name == "drop":
            return outcome(lambda: impl.drop_holder(self.blocks, self.engines[op[1]], 1 << op[1]))
        if name == "walk":
            return outcome(lambda: impl.walk(self.blocks, op[1], op[2], nogil=op[3]))
        return outcome(lambda: impl.extend(self.blocks, op[1], op[2], op[3]))

    def contents(self) -> list[list[tuple[int, int]]]:
        maps = [self.blocks, self.tombs, *self.engines]
        return [sorted(m.items()) for m in maps]


@needs_c
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(index_runs)
def test_block_functions_match_reference(ops: list[tuple[Any, ...]]) -> None:
    """store/store_run/remove/drop/walk/extend on random states: the reference's results and
    tables, exceptions (a run of the wrong length) included."""
    ours, ref = Tables(c()), Tables(py_impl)
    for op in ops:
        assert ours.apply(op) == ref.apply(op), op
        assert ours.contents() == ref.contents(), op


@pytest.mark.parametrize("impl", IMPLS)
def test_store_chain_is_all_or_nothing(impl: ModuleType) -> None:
    """A chain with a known or repeated engine hash changes nothing; a fresh one reports sharing."""
    blocks, engine, other = impl.U64Map(), impl.U64Map(), impl.U64Map()
    assert impl.store_chain(blocks, engine, 1, [1, 2], [10, 11]) == []
    assert impl.store_chain(blocks, engine, 1, [3, 2], [12, 13]) is None
    repeated = [*range(100, 200), 150]
    assert impl.store_chain(blocks, engine, 1, repeated, list(range(101))) is None
    assert sorted(engine.items()) == [(1, 10), (2, 11)]
    assert impl.store_chain(blocks, engine, 1, [5, 6], [10, 12]) == [10]
    assert impl.store_chain(blocks, other, 2, [1], [10]) == []
    assert sorted(blocks.items()) == [(10, 3), (11, 1), (12, 1)]
    assert impl.walk(blocks, [10, 11, 12], 3) == [(2, 1), (1, 3)]
    with pytest.raises(ValueError):
        impl.store_chain(blocks, engine, 1, [7], [])


@pytest.mark.parametrize("impl", IMPLS)
def test_remove_and_drop(impl: ModuleType) -> None:
    """Removal reports unknown hashes as given and leaves tombstones; drop empties the holder."""
    blocks, engine, tombs = impl.U64Map(), impl.U64Map(), impl.U64Map()
    impl.store_chain(blocks, engine, 1, [-1, 2, 3], [10, 11, 12])
    impl.store_chain(blocks, impl.U64Map(), 2, [9], [11])
    assert impl.remove_blocks(blocks, engine, tombs, 1, [-1, 99, U64 - 1]) == [99, U64 - 1]
    assert list(tombs.items()) == [(-1, 10)] and 10 not in blocks
    impl.drop_holder(blocks, engine, 1)
    assert len(engine) == 0 and sorted(blocks.items()) == [(11, 2)]
    assert impl.extend(blocks, [11, 12], 0, 2) == 1


# ------------------------------------------------------------------ chain_hashes


@needs_c
@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=700), st.integers(1, 40), st.integers(0, U64 - 1))
def test_chain_hashes_match_reference(packed: bytes, block_size: int, seed: int) -> None:
    """Chained hashes agree bit for bit, for bytes, bytearray and memoryview inputs."""
    want = py_impl.chain_hashes(packed, block_size, seed)
    assert c().chain_hashes(packed, block_size, seed) == want
    assert c().chain_hashes(bytearray(packed), block_size, seed) == want
    assert c().chain_hashes(memoryview(packed), block_size, seed) == want


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_hashes_long_input_and_bad_block_size(impl: ModuleType) -> None:
    """A run long enough to hash without the GIL agrees; a block size below 1 is refused."""
    packed = random.Random(3).randbytes(16 * 4 * 3000 + 12)
    assert impl.chain_hashes(packed, 16, 5) == py_impl.chain_hashes(packed, 16, 5)
    assert all(h < 2**60 for h in impl.chain_hashes(packed, 16, 5))
    assert impl.chain_hashes(packed, 2**40, 5) == []
    for bad in (0, -1):
        with pytest.raises(ValueError):
            impl.chain_hashes(packed, bad, 0)


def test_chain_hashes_needs_xxh3() -> None:
    """The C chain_hashes refuses to run before init_xxh3 rather than jump to nowhere."""
    import subprocess

    if c_impl is None:
        pytest.skip(C_MISSING)
    code = (
        # Load the extension by file, without the package that initialises it on import.
        "import glob, importlib.util as u, kvevents\n"
        "path = glob.glob(kvevents.__path__[0] + '/index/_blocktable*.so')[0]\n"
        "spec = u.spec_from_file_location('kvevents.index._blocktable', path)\n"
        "b = u.module_from_spec(spec); spec.loader.exec_module(b)\n"
        "try:\n    b.chain_hashes(b'', 1, 0)\nexcept RuntimeError:\n    print('refused')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "refused"


# ------------------------------------------------------------------ token packing

EDGE_MSGPACK = [
    b"\x90",
    b"",
    b"\x91",
    b"\x91\x91\x01",
    b"\x91\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00",
    b"\x91\xff",
    b"\x91\xe0",
    b"\x91\xd0\xff",
    b"\x91\xd0\x7f",
    b"\x91\xd3\x00\x00\x00\x00\xff\xff\xff\xff",
    b"\x91\xd3\x00\x00\x00\x01\x00\x00\x00\x00",
    b"\x91\xce\xff\xff\xff\xff",
    b"\x91\xcf\x00\x00\x00\x01\x00\x00\x00\x00",
    b"\x91\xcf\x00\x00\x00\x00\x00\x00\x00\x05",
    b"\x91\xcd\x01",
    b"\xdc\x00\x00",
    b"\xdc\x00",
    b"\xdd\x00\x00\x00\x00",
    b"\xdd\xff\xff\xff\xff",
    b"\xdd\x00\x00\x00\x02\x01\x02",
    b"\x91\x01\x01",
    b"\x81\x01\x01",
    b"\xc0",
    b"\x91\xc0",
    b"\x91\xc3",
    b"\x91\xa1a",
    b"\x01",
]


@pytest.mark.parametrize("raw", EDGE_MSGPACK)
def test_pack_msgpack_edge_cases(raw: bytes) -> None:
    """Hand-picked valid and invalid msgpack: the C parser answers as the reference does."""
    want = py_impl.pack_msgpack_tokens(raw)
    if c_impl is None:
        pytest.skip(C_MISSING)
    assert c().pack_msgpack_tokens(raw) == want
    assert c().pack_msgpack_tokens(msgspec.Raw(raw)) == want


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_huge_arrays(impl: ModuleType) -> None:
    """100k tokens in array32 msgpack pack to the same little-endian bytes."""
    tokens = [random.Random(1).getrandbits(32) for _ in range(100_000)]
    want = struct.pack(f"<{len(tokens)}I", *tokens)
    assert impl.pack_msgpack_tokens(msgspec.msgpack.encode(tokens)) == want
    assert impl.pack_msgpack_tokens(msgspec.msgpack.encode([*tokens, -1])) is None


def msgpack_int(v: int, form: str) -> bytes:
    """One int in a chosen msgpack encoding (not always the shortest)."""
    if form == "fix" and 0 <= v < 128:
        return bytes([v])
    if form == "fix" and -32 <= v < 0:
        return struct.pack(">b", v)
    codes = {"u8": (0xCC, ">B"), "u16": (0xCD, ">H"), "u32": (0xCE, ">I"), "u64": (0xCF, ">Q")}
    codes |= {"i8": (0xD0, ">b"), "i16": (0xD1, ">h"), "i32": (0xD2, ">i"), "i64": (0xD3, ">q")}
    code, fmt = codes.get(form, (0xD3, ">q"))
    try:
        return bytes([code]) + struct.pack(fmt, v)
    except struct.error:
        return b"\xd3" + struct.pack(">q", max(min(v, 2**63 - 1), -(2**63)))


token_values = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 200),
    st.sampled_from([2**32, 2**32 - 1, -1, -32, -33, 2**63, U64 - 1]),
)
forms = st.sampled_from(["fix", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"])


@st.composite
def msgpack_arrays(draw: st.DrawFn) -> bytes:
    items = draw(st.lists(st.tuples(token_values, forms), max_size=20))
    body = b"".join(msgpack_int(v, form) for v, form in items)
    n = len(items)
    headers = [b"\xdc" + struct.pack(">H", n), b"\xdd" + struct.pack(">I", n)]
    if n < 16:
        headers.append(bytes([0x90 | n]))
    header = draw(st.sampled_from(headers))
    raw = header + body
    cut = draw(st.sampled_from(["whole", "whole", "whole", "truncate", "extend"]))
    if cut == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif cut == "extend":
        raw += draw(st.binary(min_size=1, max_size=3))
    return raw


@needs_c
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(st.one_of(msgpack_arrays(), st.binary(max_size=20)))
def test_pack_msgpack_matches_reference(raw: bytes) -> None:
    """Random msgpack arrays (any int encoding, truncated or extended) and random bytes agree."""
    assert c().pack_msgpack_tokens(raw) == py_impl.pack_msgpack_tokens(raw)


# ------------------------------------------------------------------ selection


def test_selector_picks_c_when_required() -> None:
    """With KVEVENTS_REQUIRE_NATIVE=1 (CI) the selector must have picked the C extension."""
    if os.environ.get("KVEVENTS_PURE_PYTHON") == "1":
        pytest.skip("KVEVENTS_PURE_PYTHON=1: the fallback is under test")
    if os.environ.get("KVEVENTS_REQUIRE_NATIVE") != "1" and blocktable.IMPLEMENTATION != "c":
        pytest.skip(f"the pure-Python block table is in use: {blocktable.FALLBACK_REASON}")
    assert blocktable.IMPLEMENTATION == "c", blocktable.FALLBACK_REASON
    assert blocktable.U64Map is c().U64Map


def test_selector_honours_pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVEVENTS_PURE_PYTHON=1 selects the reference and says so."""
    monkeypatch.setenv("KVEVENTS_PURE_PYTHON", "1")
    impl, reason = blocktable._select()
    assert impl is py_impl and impl.IMPLEMENTATION == "python"
    assert reason == "KVEVENTS_PURE_PYTHON=1"
