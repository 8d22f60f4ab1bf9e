"""The HTTP request bodies, with a bound on every field, and their decoding.

Every number a client sends has a range and every string a length, so a request is refused
with a 400 naming the field and the rule (``Expected `int` <= 1024 - at `$.ranks```) before
anything is built from it: no ``ranks: 2**62`` reaches ``range()``, no ``block_size: -1``
reaches the index. A registration's own fields are bounded by :mod:`kvevents.service.bounds`
(the same bounds hold for one restored from a state file or a scale-out record). Pure: no
sockets, no service.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

# The registration's bounds live in kvevents.bounds (every source of a registration holds to
# them); re-exported here, where the HTTP bodies use them.
from kvevents.bounds import (
    MAX_ENDPOINT_LENGTH,
    MAX_NAME_LENGTH,
    MAX_RANKS,
)
from kvevents.events import Digest
from kvevents.http._errors import BadRequest
from kvevents.index.keys import MMSpan
from kvevents.service.bounds import (
    BlockSize,
    EndpointText,
    Name,
    Rank,
    RankCount,
    Text,
)
from kvevents.service.feed import OwnEndpoints, WorkerRegistration

__all__ = [
    "MAX_LOAD_BLOCKS",
    "MAX_LOAD_ENTRIES",
    "CacheSalt",
    "LoadBody",
    "LoadEntry",
    "MMItem",
    "QueryBody",
    "QueryPackedBody",
    "RegisterBody",
    "UnregisterBody",
    "check_hashes",
    "decode",
    "mm_spans",
    "registration",
    "worker_id",
]

_MAX_HASHES = 1 << 20
_NAME_LEN = MAX_NAME_LENGTH
_ENDPOINT_LEN = MAX_ENDPOINT_LENGTH
_INT64 = (1 << 63) - 1
_MAX_MM_ITEMS = 4096

InstanceId = Annotated[int, msgspec.Meta(ge=-_INT64, le=_INT64)]
# msgspec bounds must fit in int64: the top of the uint64 range is checked by check_hashes.
BlockHash = Annotated[int, msgspec.Meta(ge=0)]
_HASH_MAX = (1 << 64) - 1
LoraId = Annotated[int, msgspec.Meta(ge=0, le=_INT64)]
#: The largest load a report may give, in blocks: far above any engine's KV cache (a few
#: million blocks), low enough that a sum of many stays exact in a float score.
MAX_LOAD_BLOCKS = 1 << 40
#: The most (worker, rank) entries one ``POST /load`` may carry.
MAX_LOAD_ENTRIES = 4096
LoadBlocks = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOAD_BLOCKS)]


class RegisterBody(msgspec.Struct, kw_only=True):
    """``POST /register``."""

    endpoint: EndpointText
    block_size: BlockSize
    worker_id: Name | None = None
    instance_id: Name | InstanceId | None = None
    replay_endpoint: EndpointText | None = None
    ranks: RankCount | Annotated[list[Rank], msgspec.Meta(max_length=MAX_RANKS)] | None = None
    dp_size: RankCount | None = None
    dp_rank: Rank | None = None
    topic: Text = ""
    model_name: Text | None = None
    report_mode: Literal["incremental", "full"] = "incremental"


class UnregisterBody(msgspec.Struct, kw_only=True):
    """``POST /unregister``."""

    worker_id: Name | None = None
    instance_id: Name | InstanceId | None = None
    rank: Rank | None = None
    dp_rank: Rank | None = None


class LoadEntry(msgspec.Struct, kw_only=True):
    """One (worker, rank)'s load in a ``POST /load``: both terms, as the router's ``Load``."""

    queued_blocks: LoadBlocks
    active_blocks: LoadBlocks
    worker_id: Name | None = None
    instance_id: Name | InstanceId | None = None
    rank: Rank | None = None
    dp_rank: Rank | None = None


class LoadBody(msgspec.Struct, kw_only=True):
    """``POST /load``: the current load of some (worker, rank) targets."""

    loads: Annotated[list[LoadEntry], msgspec.Meta(min_length=1, max_length=MAX_LOAD_ENTRIES)]


class MMItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One multimodal item of the request: the engine's hash of it (vLLM's ``mm_hash``) and
    the token ids it covers, ``offset`` and ``length`` in ``token_ids``."""

    hash: Name
    offset: Annotated[int, msgspec.Meta(ge=0, le=_INT64)]
    length: Annotated[int, msgspec.Meta(ge=1, le=_INT64)]


CacheSalt = Annotated[
    str,
    msgspec.Meta(
        max_length=MAX_NAME_LENGTH,
        description="the request's cache_salt, as sent to the engine: only blocks cached "
        "under the same salt match (none: only unsalted blocks)",
    ),
]
MMItems = Annotated[
    list[MMItem],
    msgspec.Meta(
        max_length=_MAX_MM_ITEMS,
        description="the request's multimodal items: blocks they overlap match only blocks "
        "cached with the same items at the same offsets",
    ),
]


Weight = Annotated[
    float,
    msgspec.Meta(
        ge=0,
        le=1e6,
        description="a cost weight of the routing policy for this request (prefix_load: "
        "prefill_weight scales prefill blocks, load_weight the load terms; default: the "
        "service's --prefill-weight / --load-weight)",
    ),
]


class QueryBody(msgspec.Struct, kw_only=True):
    """``POST /query``. Token ids are checked by the packer (uint32), not here; a string token
    is a multimodal item's digest (as TensorRT-LLM's stores carry them), part of its block's
    key."""

    token_ids: list[int | Digest] | None = None
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=_MAX_HASHES)] | None = None
    block_size: BlockSize | None = None
    policy: Text | None = None
    lora_name: Text | None = None
    lora_id: LoraId | None = None
    model_name: Text | None = None
    cache_salt: CacheSalt | None = None
    mm_items: MMItems | None = None
    prefill_weight: Weight | None = None
    load_weight: Weight | None = None


class QueryPackedBody(QueryBody, kw_only=True):
    """``QueryBody`` with ``token_ids`` left as JSON text, for a packer that reads it directly."""

    # The one field whose type a subclass changes: msgspec decodes by this annotation, while
    # mypy holds an override to its base's type.
    token_ids: msgspec.Raw = msgspec.Raw()  # type: ignore[assignment]


T = TypeVar("T")


def decode(body: bytes, decoder: msgspec.json.Decoder[T], where: str) -> T:
    """``body`` decoded by ``decoder``; BadRequest naming the field and rule otherwise.

    Deep nesting makes msgspec raise RecursionError, which is the client's fault too.
    """
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise BadRequest(f"{where}: {exc}") from None
    except RecursionError:
        raise BadRequest(f"{where}: JSON is nested too deeply") from None


def check_hashes(hashes: list[int] | None) -> None:
    """BadRequest naming the first block hash outside uint64, if any."""
    if hashes and max(hashes) > _HASH_MAX:
        i = next(i for i, h in enumerate(hashes) if h > _HASH_MAX)
        raise BadRequest(f"/query: block hash at `$.block_hashes[{i}]` is over {_HASH_MAX}")


def mm_spans(query: QueryBody) -> tuple[MMSpan, ...]:
    """The query's multimodal items as the index takes them; BadRequest when used with
    ``block_hashes`` (precomputed hashes have no tokens to key them by)."""
    items = query.mm_items or ()
    if (items or query.cache_salt) and query.block_hashes is not None:
        raise BadRequest("/query: cache_salt and mm_items apply to token_ids, not block_hashes")
    return tuple(MMSpan(m.hash, m.offset, m.length) for m in items)


def worker_id(body: RegisterBody | UnregisterBody | LoadEntry) -> str:
    """The worker named by ``worker_id`` or, Dynamo's name for it, ``instance_id``."""
    worker: str | int | None = body.worker_id if body.worker_id is not None else body.instance_id
    if worker is None:
        raise BadRequest("worker_id (or instance_id) is required")
    return str(worker)


def _ranks(body: RegisterBody) -> tuple[int, ...]:
    count = body.ranks if body.ranks is not None else body.dp_size
    if isinstance(count, list):
        if not count:
            raise BadRequest("ranks must be a count >= 1 or a non-empty list of rank numbers")
        return tuple(sorted(set(count)))
    return tuple(range(count if count is not None else 1))


def registration(body: RegisterBody) -> WorkerRegistration:
    """The registration a valid ``POST /register`` body asks for (endpoints not yet checked).

    With ``dp_rank``, the one rank publishing on ``endpoint`` itself, to be added to the
    worker's other ranks (``IndexService.add_rank``).
    """
    own: tuple[OwnEndpoints, ...] = ()
    if body.dp_rank is not None:
        if body.ranks is not None or body.dp_size is not None:
            raise BadRequest(
                "dp_rank registers one rank on an endpoint of its own: "
                "it cannot be combined with ranks or dp_size"
            )
        own = (OwnEndpoints(body.dp_rank, body.endpoint, body.replay_endpoint),)
    return WorkerRegistration(
        worker_id=worker_id(body),
        endpoint=body.endpoint,
        block_size=body.block_size,
        ranks=(body.dp_rank,) if body.dp_rank is not None else _ranks(body),
        replay_endpoint=body.replay_endpoint,
        topic=body.topic,
        model_name=body.model_name,
        own_endpoints=own,
        report_mode=body.report_mode,
    )
