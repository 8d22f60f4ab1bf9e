"""Our chained block hash of token ids (kvevents.index._keys)."""

from __future__ import annotations

import pytest
import xxhash

from kvevents.index._keys import MASK, ROOT_SEED, block_hashes, chain_hashes, pack_tokens, root_seed


def test_golden_values() -> None:
    """The scheme is pinned: changing it silently would split every deployed index."""
    assert ROOT_SEED == 371342210119399861
    assert block_hashes(list(range(8)), 4) == [247158293717596558, 848917601645267292]
    assert block_hashes([1, 2, 3, 4], 4, lora="a") == [250441747145972414]


def test_scheme_matches_its_documentation() -> None:
    """h[i] = xxh3_64(le-uint32 tokens of block i, seed=h[i-1]) & (2**60 - 1)."""
    tokens = [7, 70000, 3, 2**32 - 1, 5, 6]
    first = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in tokens[:3]), ROOT_SEED
    )
    second = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in tokens[3:]), first & MASK
    )
    assert block_hashes(tokens, 3) == [first & MASK, second & MASK]


def test_hash_names_the_whole_prefix() -> None:
    """The same block after different prefixes hashes differently; a prefix's hashes are stable."""
    a = block_hashes([1, 2, 9, 9], 2)
    b = block_hashes([3, 4, 9, 9], 2)
    assert a[1] != b[1]
    assert block_hashes([1, 2, 9, 9, 5, 5], 2)[:2] == a


def test_partial_last_block_is_ignored() -> None:
    """Only full blocks are hashed."""
    assert len(block_hashes(list(range(10)), 4)) == 2
    assert block_hashes([1, 2, 3], 4) == []


def test_lora_changes_the_root() -> None:
    """A LoRA adapter's blocks never match the base model's; id and name keys differ."""
    assert root_seed(None) == ROOT_SEED
    assert len({root_seed(None), root_seed("x"), root_seed(1), root_seed("1")}) == 4
    assert block_hashes([1, 2], 2, lora="x") != block_hashes([1, 2], 2)


def test_chain_hashes_continues_from_a_parent() -> None:
    """Hashing a suffix seeded with the parent's hash equals hashing the whole prefix."""
    tokens = list(range(12))
    whole = block_hashes(tokens, 4)
    assert chain_hashes(pack_tokens(tokens[4:]), 4, whole[0]) == whole[1:]


def test_token_out_of_range_raises() -> None:
    """Token ids are uint32: anything else is an OverflowError, not a silent wrap."""
    with pytest.raises(OverflowError):
        pack_tokens([-1])
    with pytest.raises(OverflowError):
        pack_tokens([2**32])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)
