"""Chained block hashing: deterministic, engine-style 64-bit values, chained by parent."""

from __future__ import annotations

import pytest

from kvevents.sim._hashing import block_hash, engine_chain_hashes


def test_hash_values_are_pinned() -> None:
    """The digest layout never changes silently: values are pinned for both styles."""
    assert block_hash(None, [1, 2, 3, 4]) == 7715859099524146017
    assert block_hash(None, [1, 2, 3, 4], style="signed") == 1405213874966971941


def test_styles_cover_unsigned_and_signed_64_bit() -> None:
    """Unsigned hashes stay in [0, 2**64); signed ones in [-2**63, 2**63) and go negative."""
    unsigned = [block_hash(None, [i]) for i in range(200)]
    signed = [block_hash(None, [i], style="signed") for i in range(200)]
    assert all(0 <= h < 2**64 for h in unsigned) and max(unsigned) >= 2**63
    assert all(-(2**63) <= h < 2**63 for h in signed) and min(signed) < 0


def test_chain_matches_block_by_block_and_drops_partial_tail() -> None:
    """engine_chain_hashes equals block_hash applied along the chain; a partial block gets none."""
    tokens = list(range(10))
    chain = engine_chain_hashes(tokens, 4, style="signed")
    assert len(chain) == 2
    first = block_hash(None, tokens[:4], style="signed")
    assert chain == [first, block_hash(first, tokens[4:8], style="signed")]
    assert engine_chain_hashes(tokens[8:], 4, parent=chain[-1]) == []


def test_parent_and_salt_change_the_hash() -> None:
    """Same tokens under another parent, or another salt (LoRA), hash differently."""
    assert block_hash(None, [1, 2]) != block_hash(5, [1, 2])
    assert block_hash(None, [1, 2]) != block_hash(None, [1, 2], salt=b"lora-a")
    assert engine_chain_hashes([1, 2, 3, 4], 2)[1] != engine_chain_hashes([9, 9, 3, 4], 2)[1]


def test_bad_arguments_are_rejected() -> None:
    """Unknown styles and non-positive block sizes fail with a message naming the value."""
    with pytest.raises(ValueError, match="'sha'"):
        block_hash(None, [1], style="sha")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 0"):
        engine_chain_hashes([1], 0)
