"""Our own chained block hash of token ids, so every engine's blocks land on the same keys.

Engines hash blocks their own way (vLLM: SHA-256 of a pickled tuple; SGLang and TensorRT-LLM:
other schemes), so engine hashes never agree across engines and cannot be computed by a
router from a request. The index therefore keys blocks by this hash of ``token_ids``, and
keeps engine hashes only to resolve parents and removals (WIRE.md section 2, Hashes).

The scheme, exactly:

- Tokens are packed as unsigned 32-bit little-endian integers (``array("I")`` on every
  platform we support), ``block_size`` tokens per block.
- ``h[0] = xxh3_64(block_0_bytes, seed=root) & MASK`` and ``h[i] = xxh3_64(block_i_bytes,
  seed=h[i-1]) & MASK`` with ``MASK = 2**60 - 1``: the parent's hash is the seed of its child,
  so a hash names the whole prefix up to and including its block. Sixty bits, because a
  CPython int up to 2**60 takes 32 bytes and a larger one 40: the index holds one per block.
- ``root`` is :data:`ROOT_SEED` for the base model. With a LoRA adapter it is
  ``xxh3_64(b"lora:" + name, seed=ROOT_SEED) & MASK`` for an adapter name (UTF-8), or
  ``xxh3_64(b"lora-id:" + decimal id, seed=ROOT_SEED) & MASK`` for an adapter id. The index
  uses the event's ``lora_name`` when set, else its ``lora_id``.
- Only full blocks are hashed; trailing tokens that do not fill a block are ignored.

Hashes are non-negative Python ints below 2**60. A token id outside ``0 .. 2**32 - 1`` raises
``OverflowError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvevents.index import table
from kvevents.index._table_py import pack_tokens

__all__ = ["MASK", "ROOT_SEED", "block_hashes", "chain_hashes", "pack_tokens", "root_seed"]

#: Seed of the first block of a base-model prefix (``xxh3_64(b"kvevents") & MASK``, fixed).
ROOT_SEED: int = xxhash.xxh3_64_intdigest(b"kvevents") & (2**60 - 1)

#: Hashes keep their low 60 bits (see the module docstring).
MASK: int = 2**60 - 1

_xxh3 = xxhash.xxh3_64_intdigest

#: ``chain_hashes(packed, block_size, seed)``: the chained hashes of every full block of
#: ``packed`` tokens, the first seeded by ``seed`` (:func:`root_seed` for a prefix starting at
#: token 0, else the hash of the block before). The table primitive itself (C where built).
chain_hashes = table.chain_hashes


def root_seed(lora: str | int | None = None) -> int:
    """The seed of a prefix's first block: :data:`ROOT_SEED`, or one derived from a LoRA key."""
    if lora is None:
        return ROOT_SEED
    key = b"lora:" + lora.encode() if isinstance(lora, str) else b"lora-id:%d" % lora
    return _xxh3(key, ROOT_SEED) & MASK


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, lora: str | int | None = None
) -> list[int]:
    """The chained block hashes of a whole request's tokens (full blocks only)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return chain_hashes(pack_tokens(token_ids), block_size, root_seed(lora))
