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
- A block with *extra inputs* (vLLM's per-block ``extra_keys``: a cache salt on the first
  block, ``[mm_identifier, offset]`` pairs on the blocks a multimodal item overlaps) is keyed
  ``x[i] = xxh3_64(b"extra:" + msgpack(extras_i), seed=h[i]) & MASK``, where ``h[i]`` is the
  token hash above and ``extras_i`` the block's extras as one msgpack array (strings, ints and
  bytes as they came, pairs as 2-element arrays). ``x[i]`` then seeds the next block, so every
  later block differs too. A block without extras is keyed as before: unsalted keys are
  unchanged. The LoRA name vLLM puts first in every block's extras is not an extra here: the
  root seed already carries it.
- A *digest token* (TensorRT-LLM puts a multimodal item's hex digest in ``token_ids`` where
  the item's tokens are) packs as 0 and adds ``["digest", offset_in_block, digest]`` to its
  block's extras, in token order, after the block's other extras.
- A block whose identity covers the ``L`` tokens after it (*lookahead*: vLLM's
  lookahead-aware hashing for EAGLE-style drafters, SGLang's EAGLE bigram keys, ``L = 1``) is
  keyed ``y[i] = xxh3_64(b"next:" + next_L_tokens_packed, seed=k[i]) & MASK``, where
  ``k[i]`` is its key as above (token hash, extras mixed in) seeded by ``y[i-1]``. A request
  has such a block only when it holds the ``L`` tokens after it.

Hashes are non-negative Python ints below 2**60. A token id outside ``0 .. 2**32 - 1`` raises
``OverflowError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import xxhash

from kvevents.index import _table as table
from kvevents.index._table_py import pack_tokens

__all__ = [
    "MASK",
    "ROOT_SEED",
    "Extras",
    "MMSpan",
    "block_hashes",
    "chain_hashes",
    "chain_keys",
    "digest_blocks",
    "digest_extras",
    "merge_extras",
    "mix_extras",
    "pack_tokens",
    "request_extras",
    "request_keys",
    "root_seed",
    "split_digests",
]

#: One block's extra inputs (a list of msgpack-able values), or None for a block without.
Extras = Sequence[Any] | None


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


_encode = msgspec.msgpack.encode


class MMSpan(NamedTuple):
    """One multimodal item of a request: the engine's identifier (vLLM's ``mm_hash``) and the
    tokens it covers, ``offset`` and ``length`` in the request's token ids."""

    identifier: str
    offset: int
    length: int


# Any msgpack-encodable values, hashed as encoded.
def mix_extras(token_hash: int, extras: Sequence[Any]) -> int:
    """The key of a block with extra inputs, from the hash of its tokens (module docstring)."""
    return _xxh3(b"extra:" + _encode(list(extras)), token_hash) & MASK


def chain_keys(
    packed: bytes, block_size: int, seed: int, extras: Sequence[Extras], after: bytes = b""
) -> list[int]:
    """:func:`chain_hashes` where ``extras[i]`` (if any) enters block ``i``'s key, and with
    ``after`` (the packed tokens following the last block) each block's lookahead does too:
    its key covers as many tokens after it as ``after`` holds (module docstring).

    Runs of blocks without extras or lookahead are hashed by one table call each.
    """
    if after:
        return _chain_ahead(packed, block_size, seed, extras, after)
    step = 4 * block_size
    out: list[int] = []
    start = 0
    for i, extra in enumerate(extras[: len(packed) // step]):
        if not extra:
            continue
        if i > start:
            out += chain_hashes(packed[start * step : i * step], block_size, seed)
        parent = out[-1] if out else seed
        [token_hash] = chain_hashes(packed[i * step : (i + 1) * step], block_size, parent)
        out.append(mix_extras(token_hash, extra))
        start = i + 1
    out += chain_hashes(packed[start * step :], block_size, out[-1] if out else seed)
    return out


def _chain_ahead(
    packed: bytes, block_size: int, seed: int, extras: Sequence[Extras], after: bytes
) -> list[int]:
    step, width = 4 * block_size, len(after)
    tail = packed + after
    out: list[int] = []
    parent = seed
    for i in range(len(packed) // step):
        end = (i + 1) * step
        [key] = chain_hashes(packed[end - step : end], block_size, parent)
        extra = extras[i] if i < len(extras) else None
        if extra:
            key = mix_extras(key, extra)
        parent = _xxh3(b"next:" + tail[end : end + width], key) & MASK
        out.append(parent)
    return out


def digest_extras(tokens: Sequence[int | str], block_size: int) -> tuple[bytes, list[Extras]]:
    """Tokens where some are digests (str), packed with 0 in their place, and each full
    block's digest extras (:func:`digest_blocks`).

    Raises ``OverflowError`` for an int token outside uint32 and ``TypeError`` for a token
    that is neither an int nor a str.
    """
    ints, digests = split_digests(tokens)
    return pack_tokens(ints), digest_blocks(digests, len(tokens) // block_size, block_size)


def split_digests(tokens: Sequence[int | str]) -> tuple[list[int], list[tuple[int, str]]]:
    """Int tokens (0 where a digest is) and the ``(position, digest)`` of every digest token."""
    ints: list[int] = []
    digests: list[tuple[int, str]] = []
    for i, token in enumerate(tokens):
        if isinstance(token, str):
            digests.append((i, token))
            ints.append(0)
        elif isinstance(token, int) and not isinstance(token, bool):
            ints.append(token)
        else:
            raise TypeError(f"token {i} is a {type(token).__name__}, not an int or a digest")
    return ints, digests


def digest_blocks(digests: Sequence[tuple[int, str]], blocks: int, block_size: int) -> list[Extras]:
    """Each of ``blocks`` blocks' digest extras: ``["digest", offset_in_block, digest]`` per
    digest token in it, in token order (None for a block without)."""
    out: list[Extras] = [None] * blocks
    for position, digest in digests:
        block = position // block_size
        if block < blocks:
            out[block] = [*(out[block] or ()), ["digest", position % block_size, digest]]
    return out


def merge_extras(first: Sequence[Extras] | None, then: Sequence[Extras] | None) -> list[Extras]:
    """Per block, ``first``'s extras followed by ``then``'s (either may be shorter or None)."""
    a, b = first or (), then or ()
    out: list[Extras] = []
    for i in range(max(len(a), len(b))):
        x = [*(a[i] or () if i < len(a) else ()), *(b[i] or () if i < len(b) else ())]
        out.append(x or None)
    return out


def request_extras(
    blocks: int, block_size: int, cache_salt: str | None = None, mm: Sequence[MMSpan] = ()
) -> list[Extras] | None:
    """Each block's extras as vLLM computes them for a request, up to the last block with
    any (None when no block has any).

    Block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)``: it gets
    ``[identifier, offset - start]`` for every item it overlaps, in ``mm`` order, then the
    salt if it is block 0 (an empty salt is none, as in vLLM).
    """
    if not cache_salt and not mm:
        return None
    spans = sorted(mm, key=lambda m: m.offset)
    # Blocks past the last item and block 0 have none: the list stops there (chain_keys
    # hashes the rest as one run).
    last = max([1, *((m.offset + m.length + block_size - 1) // block_size for m in spans)])
    out: list[Extras] = []
    for i in range(min(blocks, last)):
        start = i * block_size
        end = start + block_size
        extra: list[Any] = [  # [identifier, offset] pairs: str and int mixed
            [m.identifier, m.offset - start]
            for m in spans
            if m.offset < end and start < m.offset + m.length
        ]
        if i == 0 and cache_salt:
            extra.append(cache_salt)
        out.append(extra or None)
    return out


def request_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora: str | int | None = None,
    cache_salt: str | None = None,
    mm: Sequence[MMSpan] = (),
) -> list[int]:
    """The keys of a request's full blocks, as the index keys the engine's own stores of
    them: LoRA in the root seed, the salt and multimodal items as extras (vLLM's way)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    packed = pack_tokens(token_ids)
    extras = request_extras(len(packed) // (4 * block_size), block_size, cache_salt, mm)
    seed = root_seed(lora)
    if extras is None:
        return chain_hashes(packed, block_size, seed)
    return chain_keys(packed, block_size, seed, extras)
