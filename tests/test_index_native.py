"""The C table module's safety: every entry point that reads bytes, fuzzed at the edge of memory.

Each input is also placed so that its last byte is the last readable byte of a page followed
by an unreadable one: a read one byte past the end is then a crash here, with or without a
sanitizer (``make sanitize`` runs this file again under ASan and UBSan, with more examples).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

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

pytestmark = pytest.mark.skipif(c_impl is None, reason=C_MISSING or "C extension available")
#: Examples per fuzz test; the sanitizer job raises it.
EXAMPLES = int(os.environ.get("KVEVENTS_FUZZ_EXAMPLES", "200"))
PAGE = mmap.PAGESIZE


def c() -> ModuleType:
    assert c_impl is not None
    return c_impl


class _GuardedPage:
    """One readable page followed by an unreadable one (Linux: mmap, then mprotect)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 4
        libc.mmap.argtypes.append(ctypes.c_long)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        if libc.mprotect(address + PAGE, PAGE, 0) != 0:
            libc.munmap(address, 2 * PAGE)
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self.libc, self.address = libc, address

    def at_end(self, data: bytes) -> memoryview:
        """``data`` copied so that it ends exactly where the readable page ends."""
        assert len(data) <= PAGE
        start = self.address + PAGE - len(data)
        ctypes.memmove(start, data, len(data))
        return memoryview((ctypes.c_char * len(data)).from_address(start)).cast("B")

    def close(self) -> None:
        self.libc.munmap(self.address, 2 * PAGE)


@contextmanager
def guarded() -> Iterator[_GuardedPage]:
    if not sys.platform.startswith("linux"):
        pytest.skip("guard pages are set up with Linux mmap/mprotect")
    page = _GuardedPage()
    try:
        yield page
    finally:
        page.close()


def agree(call: Callable[[ModuleType, Any], Any], data: bytes) -> None:
    """The C call on ``data`` (as bytes, and flush against a guard page) equals the reference's."""
    want = _outcome(lambda: call(py_impl, data))
    assert _outcome(lambda: call(c(), data)) == want
    with guarded() as page:
        view = page.at_end(data)
        try:
            got = _outcome(lambda: call(c(), view))
        finally:
            view.release()  # before the page is unmapped
        assert got == want


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc))


# ------------------------------------------------------------------ inputs


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


ints = st.one_of(
    st.integers(0, 127),
    st.integers(0, 2**32 - 1),
    st.sampled_from([-1, -32, -33, 2**16, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]),
)
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


fuzzed = st.one_of(st.binary(max_size=64), msgpack_arrays(), json_arrays(), json_bodies())


# ------------------------------------------------------------------ every bytes entry point


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.one_of(msgpack_arrays(), st.binary(max_size=64)))
def test_pack_msgpack_tokens_fuzzed(raw: bytes) -> None:
    """Any msgpack-ish bytes: the reference's answer, and no read past the end."""
    agree(lambda impl, data: impl.pack_msgpack_tokens(data), raw)


@settings(max_examples=EXAMPLES, deadline=None)
@given(fuzzed, st.integers(1, 9), st.sampled_from([0, 1, 2**63, 2**64 - 1]))
def test_chain_hashes_fuzzed(packed: bytes, block_size: int, seed: int) -> None:
    """Any bytes and block size: the reference's hashes, and no read past the end."""
    agree(lambda impl, data: impl.chain_hashes(data, block_size, seed), packed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(fuzzed, st.integers(1, 9), st.integers(0, 4))
def test_store_run_fuzzed(packed: bytes, block_size: int, blocks: int) -> None:
    """Any bytes, any claimed block count: stored as the reference stores, or the same error."""
    hashes = list(range(1, blocks + 1))

    def store(impl: ModuleType, data: Any) -> tuple[Any, ...]:
        tables = impl.U64Map(), impl.U64Map()
        shared = impl.store_run(*tables, 1, hashes, data, block_size, 7)
        return shared, sorted(tables[0].items()), sorted(tables[1].items())

    agree(store, packed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(fuzzed, st.integers(1, 9), st.integers(0, 12), st.integers(0, 15), st.booleans())
def test_chain_walk_fuzzed(
    packed: bytes, block_size: int, held: int, allowed: int, nogil: bool
) -> None:
    """Walking a run's chained hashes as it hashes them: the reference's groups, any bytes."""
    hashes = py_impl.chain_hashes(packed, block_size, 5)[:held]

    def walk(impl: ModuleType, data: Any) -> Any:
        blocks = impl.U64Map()
        for i, h in enumerate(hashes):  # fewer holders the deeper: one group leaves per step
            blocks[h] = (1 << (4 - min(i, 3))) - 1
        return impl.chain_walk(blocks, data, block_size, 5, allowed, nogil)

    agree(walk, packed)


# ------------------------------------------------------------------ regressions


def test_huge_declared_counts_are_refused_before_allocating() -> None:
    """An array header claiming 2**32-1 elements in a few bytes is None, not a 16 GiB buffer."""
    for raw in [b"\xdd\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff\x01\x02", b"\xdc\xff\xff\x01"]:
        assert c().pack_msgpack_tokens(raw) is None


def test_store_run_guards_its_buffer() -> None:
    """A run whose bytes are not exactly one block per hash is a ValueError, nothing stored."""
    blocks, engine = c().U64Map(), c().U64Map()
    for packed, size, hashes in [
        (b"\0" * 8, 1, [1]),
        (b"\0" * 4, 1, [1, 2]),
        (b"\0" * 6, 1, [1]),
        (b"", 2**62, [1]),
        (b"\0" * 4, 1, []),
    ]:
        with pytest.raises(ValueError, match="packed holds"):
            c().store_run(blocks, engine, 1, hashes, packed, size, 0)
    assert len(blocks) == len(engine) == 0


def test_module_uses_multi_phase_init() -> None:
    """The module is created, then executed (PEP 489): nothing is set up before exec."""
    code = (
        "import glob, importlib.util as u, kvevents\n"
        "path = glob.glob(kvevents.__path__[0] + '/index/_blocktable*.so')[0]\n"
        "spec = u.spec_from_file_location('kvevents.index._blocktable', path)\n"
        "m = spec.loader.create_module(spec)\n"
        "before = hasattr(m, 'U64Map')\n"
        "spec.loader.exec_module(m)\n"
        "print(before, m.IMPLEMENTATION, type(m.U64Map()).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "c", "U64Map"]


# ------------------------------------------------------------------ the walk without the GIL


def _walk_into(result: list[Any], blocks: Any, hashes: list[int]) -> None:
    result.append(c().walk(blocks, hashes, 1, nogil=True))


def test_walk_without_the_gil_refuses_writers_meanwhile() -> None:
    """While a walk reads a table without the GIL, every write to it raises; after, all work.

    The walk is long (two million keys, all present) so that this thread, waiting for the
    GIL the walk gave up, sees it reading; a missed window is retried, a bounded number of
    times, so the outcome does not depend on timing."""
    blocks, engine, tombs = c().U64Map(), c().U64Map(), c().U64Map()
    blocks[7] = 1
    hashes = [7] * 2_000_000
    writes: list[Callable[[], object]] = [
        lambda: blocks.__setitem__(8, 1),
        lambda: blocks.pop(7),
        blocks.clear,
        lambda: c().store_chain(blocks, engine, 2, [1], [9]),
        lambda: c().store_run(blocks, engine, 2, [1], b"\0" * 4, 1, 0),
        lambda: c().remove_blocks(blocks, engine, tombs, 1, [5]),
        lambda: c().drop_holder(blocks, engine, 1),
    ]
    for _ in range(20):
        result: list[Any] = []
        walker = threading.Thread(target=_walk_into, args=(result, blocks, hashes))
        walker.start()
        deadline = time.monotonic() + 30
        while not blocks.readers and walker.is_alive() and time.monotonic() < deadline:
            pass
        refused = []
        if blocks.readers:
            for write in writes:
                with pytest.raises(RuntimeError, match="read without the GIL"):
                    write()
                refused.append(write)
        walker.join(30)
        assert not walker.is_alive() and result == [[(1, len(hashes))]]
        if refused:
            break
    assert refused == writes, "the walk was never seen reading in 20 tries"
    assert blocks.readers == 0
    blocks[8] = 1  # writers are welcome again
    assert sorted(blocks.items()) == [(7, 1), (8, 1)]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=40), st.integers(0, 2**64 - 1))
def test_walk_without_the_gil_matches_the_walk(hashes: list[int], allowed: int) -> None:
    """The GIL-free walk gives the same groups as the usual one, on random tables."""
    blocks = c().U64Map()
    for i, h in enumerate(range(12)):
        blocks[h] = (i * 0x9E3779B97F4A7C15) % 2**64 | 1
    assert c().walk(blocks, hashes, allowed, nogil=True) == c().walk(blocks, hashes, allowed)
    with pytest.raises(OverflowError):
        c().walk(blocks, [*hashes, 2**64], allowed, nogil=True)
    assert blocks.readers == 0
