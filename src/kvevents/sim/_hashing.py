"""Chained block hashes of token ids, the way engines compute them (WIRE.md section 2, Hashes).

A block's hash covers its parent's hash, its own token ids and an optional salt (a LoRA name,
a cache salt), so equal hashes mean equal prefixes. The digest is SHA-256 over a fixed byte
layout, never Python's ``hash()`` (salted per process, so two engines would disagree):

    digest = sha256(parent (8 bytes, big-endian; b"kvevents" for the first block)
                    || token ids (signed 64-bit, little-endian, one per token)
                    || salt)

Two styles of 64-bit engine hash, so simulated engines emit what real ones emit:

- ``"unsigned"`` (vLLM): the last 8 bytes of the digest, big-endian, in ``[0, 2**64)``;
- ``"signed"`` (SGLang, TensorRT-LLM): the first 8 bytes, big-endian, two's complement.

Hashes are opaque to consumers (they hash ``token_ids`` themselves); these are for engines.
The names say so: the index keys blocks by another hash, its own (``kvevents.index._keys``:
``ROOT_SEED``, ``chain_hashes``), which has nothing to do with this one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Literal, TypeAlias

__all__ = ["ENGINE_ROOT_PARENT", "HashStyle", "block_hash", "engine_chain_hashes", "token_bytes"]

HashStyle: TypeAlias = Literal["unsigned", "signed"]

#: Stands in for the parent of a chain's first block (exactly 8 bytes, like a parent hash).
ENGINE_ROOT_PARENT = b"kvevents"
_MASK64 = 2**64 - 1
_STYLES = ("unsigned", "signed")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids in the hashed layout: signed 64-bit little-endian each."""
    packed = array("q", token_ids)
    if array("q", [1]).tobytes()[0] != 1:  # big-endian host: keep the digest portable
        packed.byteswap()
    return packed.tobytes()


def _parent_bytes(parent: int | None) -> bytes:
    if parent is None:
        return ENGINE_ROOT_PARENT
    return (parent & _MASK64).to_bytes(8, "big")


def _from_digest(digest: bytes, style: HashStyle) -> int:
    if style == "unsigned":
        return int.from_bytes(digest[-8:], "big")
    return int.from_bytes(digest[:8], "big", signed=True)


def _check_style(style: str) -> None:
    if style not in _STYLES:
        raise ValueError(f"hash style must be 'unsigned' or 'signed', got {style!r}")


def block_hash(
    parent: int | None,
    token_ids: Sequence[int],
    *,
    salt: bytes = b"",
    style: HashStyle = "unsigned",
) -> int:
    """The engine hash of one block whose parent block hashed to ``parent`` (None: first)."""
    _check_style(style)
    digest = hashlib.sha256(_parent_bytes(parent) + token_bytes(token_ids) + salt).digest()
    return _from_digest(digest, style)


def engine_chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int | None = None,
    salt: bytes = b"",
    style: HashStyle = "unsigned",
) -> list[int]:
    """Hashes of every full block of ``token_ids``; a partial last block gets none.

    ``parent`` is the hash of the block before ``token_ids[0]`` when hashing a continuation.
    Equivalent to calling :func:`block_hash` block by block, but packs the tokens once.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    _check_style(style)
    data = token_bytes(token_ids)
    width = 8 * block_size
    hashes: list[int] = []
    previous = _parent_bytes(parent)
    sha256 = hashlib.sha256
    for start in range(0, (len(token_ids) // block_size) * width, width):
        digest = sha256(previous + data[start : start + width] + salt).digest()
        value = _from_digest(digest, style)
        hashes.append(value)
        previous = (value & _MASK64).to_bytes(8, "big")
    return hashes
