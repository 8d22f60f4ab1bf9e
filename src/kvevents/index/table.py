"""The prefix index's table primitives: the C module when it is built and sound, else Python.

``kvevents.index._blocktable`` (C) and ``kvevents.index._table_py`` (the reference) share one
API of table primitives (no index rules: those live in :mod:`kvevents.index.prefix`); this
module re-exports one of them. The C module is used when it imports, its xxh3 entry point can be
taken from the ``xxhash`` package's own shared library, and it hashes a fixed vector exactly as
the reference does. ``KVEVENTS_PURE_PYTHON=1`` forces the reference. :data:`IMPLEMENTATION`
says which was picked (``"c"`` or ``"python"``); :data:`FALLBACK_REASON` says why not C.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

from kvevents.index import _table_py as _blocktable_py

__all__ = [
    "FALLBACK_REASON",
    "IMPLEMENTATION",
    "U64Map",
    "chain_hashes",
    "chain_walk",
    "drop_holder",
    "extend",
    "pack_msgpack_tokens",
    "remove_blocks",
    "store_chain",
    "store_run",
    "walk",
]

# 5 blocks of 16 tokens (with a ragged tail) under a seed with the top bit set: a wrong entry
# point, a wrong seed width or a wrong mask would all change these hashes.
_CHECK_TOKENS = bytes(range(256)) + bytes(range(76))
_CHECK_SEED = 0x9E3779B97F4A7C15


def _load_native() -> ModuleType:
    """The C module with xxh3 wired in; raises when it cannot be used."""
    import ctypes
    import importlib

    from kvevents.index import _blocktable

    # xxhash's extension carries libxxhash and exports its symbols: the same code the
    # reference calls, so both implementations hash with one xxh3.
    library = importlib.import_module("xxhash._xxhash").__file__
    if library is None:
        raise ImportError("xxhash._xxhash has no file to load")
    lib = ctypes.CDLL(library)
    address = ctypes.cast(lib.XXH3_64bits_withSeed, ctypes.c_void_p).value
    if not address:
        raise OSError("XXH3_64bits_withSeed has no address in xxhash's library")
    _blocktable.init_xxh3(address)
    want = _blocktable_py.chain_hashes(_CHECK_TOKENS, 16, _CHECK_SEED)
    got = _blocktable.chain_hashes(_CHECK_TOKENS, 16, _CHECK_SEED)
    if got != want:
        raise ValueError(f"chain_hashes self-check failed: {got} != {want}")
    return _blocktable


def _select() -> tuple[ModuleType, str | None]:
    if os.environ.get("KVEVENTS_PURE_PYTHON") == "1":
        return _blocktable_py, "KVEVENTS_PURE_PYTHON=1"
    try:
        return _load_native(), None
    except (ImportError, OSError, AttributeError, ValueError) as exc:
        return _blocktable_py, f"{type(exc).__name__}: {exc}"


_impl, FALLBACK_REASON = _select()

if TYPE_CHECKING:
    # One static type for both: the C module's stub declares the same signatures.
    from kvevents.index._table_py import (
        IMPLEMENTATION,
        U64Map,
        chain_hashes,
        chain_walk,
        drop_holder,
        extend,
        pack_msgpack_tokens,
        remove_blocks,
        store_chain,
        store_run,
        walk,
    )
else:
    IMPLEMENTATION = _impl.IMPLEMENTATION
    U64Map = _impl.U64Map
    chain_hashes = _impl.chain_hashes
    chain_walk = _impl.chain_walk
    drop_holder = _impl.drop_holder
    extend = _impl.extend
    pack_msgpack_tokens = _impl.pack_msgpack_tokens
    remove_blocks = _impl.remove_blocks
    store_chain = _impl.store_chain
    store_run = _impl.store_run
    walk = _impl.walk
