"""A store event's extra inputs, read for the index's keys (:mod:`kvevents.index._keys`).

vLLM sends ``extra_keys``, one entry per block (the LoRA name first when the request has one,
``[mm_hash, offset]`` pairs, the cache salt on the first block, prompt-embedding digests);
SGLang sends ``cache_salt`` as a field of the store. Nearly every store has none, so the test
for "none" is cheap and done on the still-encoded ``extra_keys`` of a
:class:`~kvevents.wire.PackedStored`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvevents.events import PackedStored
from kvevents.index._keys import Extras
from kvevents.index._records import Stored

__all__ = ["event_extras", "has_extras", "no_tokens", "store_extras"]


_EMPTY = msgspec.Raw(b"\x90")


def no_tokens(event: Stored) -> bool:
    """Whether a store carries no token ids (the offloading connector's placeholders)."""
    tokens = event.token_ids
    return tokens == _EMPTY if type(event) is PackedStored else not tokens


def has_extras(event: Stored, blocks: int) -> bool:
    """Whether a store may have extras: a cheap test, as nearly every store has none."""
    if event.cache_salt:
        return True
    if type(event) is PackedStored:
        # vLLM sends one nil per block: compared still encoded, no list is built.
        raw = event.extra_keys
        return len(raw) > 1 and raw != (_NILS.get(blocks) or _nils(blocks))
    extra = event.extra_keys
    return bool(extra) and any(extra)  # type: ignore[arg-type]  # a list when truthy


_NILS: dict[int, msgspec.Raw] = {}


def _nils(blocks: int) -> msgspec.Raw:
    """``[None] * blocks`` encoded, as vLLM sends the extra_keys of a store without extras."""
    if len(_NILS) > 1024:  # bounded: counts are block runs, but a peer chooses them
        _NILS.clear()
    nils = _NILS[blocks] = msgspec.Raw(msgspec.msgpack.encode([None] * blocks))
    return nils


def store_extras(event: Stored) -> list[Extras] | None:
    """A store's extras per block; SGLang's ``cache_salt`` counts only at token 0 (a later
    run's salt is in its parent's key already). ValueError when they cannot be read."""
    salt = event.cache_salt if event.parent_block_hash is None else None
    raw = event.extras() if type(event) is PackedStored else event.extra_keys
    return event_extras(raw, len(event.block_hashes), lora_name=event.lora_name, cache_salt=salt)


def event_extras(
    extra_keys: Any,  # as the engine sent them: checked here
    blocks: int,
    *,
    lora_name: str | None = None,
    cache_salt: object = None,
) -> list[Extras] | None:
    """Each block's extras from a store event, None when it has none (the common case).

    ``extra_keys`` is vLLM's list, one entry per block; the LoRA name vLLM puts first in an
    entry is dropped (the root seed carries it). ``cache_salt`` is SGLang's field, given only
    for a store starting at token 0: it is block 0's salt. Raises ValueError when
    ``extra_keys`` is not a list of one entry per block.
    """
    out: list[Extras] | None = None
    if extra_keys and any(extra_keys):
        if not isinstance(extra_keys, list) or len(extra_keys) != blocks:
            raise ValueError("extra_keys must hold one entry per block hash")
        out = [_strip_lora(extra, lora_name) for extra in extra_keys]
    if cache_salt and isinstance(cache_salt, str) and blocks:
        out = out if out is not None else [None] * blocks
        out[0] = [*(out[0] or ()), cache_salt]
    return out if out is not None and any(out) else None


# An engine's entry as sent: checked here.
def _strip_lora(extra: Any, lora_name: str | None) -> Extras:
    if not extra:
        return None
    if not isinstance(extra, list | tuple):
        raise ValueError("an extra_keys entry must be a list or null")
    if lora_name is not None and extra[0] == lora_name:
        extra = extra[1:]
    return list(extra) or None
