"""NVIDIA Dynamo's standalone KV indexer API over the index service (``kvevents serve --api
dynamo``), so that a client written for Dynamo's indexer works unchanged.

What Dynamo's indexer (ai-dynamo-runtime 1.6.1) does, and what this module does alike:

- ``POST /register`` ``{instance_id, endpoint, model_name, block_size, dp_rank?,
  replay_endpoint?}`` registers one dp rank; ``endpoint`` is that rank's own. 201
  ``{"status": "ok"}``; 409 for a rank already registered, an instance already registered for
  another model, or a block size other than the model's.
- ``POST /unregister`` ``{instance_id, model_name, routing_group?, dp_rank?}``: with
  ``routing_group`` and ``dp_rank``, that rank; otherwise the whole instance (``dp_rank`` alone
  is ignored). 200 ``{"status": "ok"}``; 404 ``instance N not found`` (or registered for
  another model).
- ``POST /query`` ``{token_ids, model_name, lora_name?, cache_salt?}``: matched *tokens*
  (blocks x block size) of the model's workers only: ``scores`` (device tier per instance and
  dp rank), ``frequencies`` (empty) and ``instances`` (per instance ``longest_matched``,
  ``gpu``, ``dp``, and ``cpu``/``disk`` cumulative through the tiers above them). 404 ``no
  indexer for model=M routing_group=G`` while no worker of the model is registered.
- ``GET /workers``: a list of ``{instance_id, source, status, model_name, routing_group,
  block_size, endpoints, listeners}``.
- A body that does not decode is a 400; one that decodes to the wrong fields or types a 422.

What differs: errors are always JSON ``{"error": ...}`` (Dynamo's 400/422 are plain text);
only the ``"default"`` routing group is served (others: 422 on register); ``/query_by_hash``
is a 501, since this index keys blocks by its own chained hashes, not by Dynamo's.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from kvevents.errors import LayoutError, RegistrationConflict, StreamAddError
from kvevents.http._errors import BadRequest
from kvevents.http._json import JsonObject, json_response
from kvevents.http._query import json_packers
from kvevents.http._schema import CacheSalt
from kvevents.index.keys import pack_tokens
from kvevents.index.records import DEFAULT_TIER, MatchResult
from kvevents.service.bounds import BlockSize, EndpointText, Rank, Text
from kvevents.service.core import IndexService
from kvevents.service.feed import OwnEndpoints, WorkerRegistration

__all__ = ["DEFAULT_GROUP", "DynamoApi", "DynamoQueryReader", "dynamo_scores"]

#: The routing group a Dynamo request names when it names none (the only one served here).
DEFAULT_GROUP = "default"
_U64 = (1 << 64) - 1
# msgspec bounds must fit in int64: the top half of Dynamo's u64 instance ids is checked below.
InstanceId = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
_CPU_TIERS = frozenset({"CPU", "CPU_PINNED", "HOST", "HOST_PINNED"})


class RegisterBody(msgspec.Struct, kw_only=True):
    """Dynamo's ``POST /register``: one dp rank of an instance, on its own endpoints."""

    instance_id: InstanceId
    endpoint: EndpointText
    model_name: Text
    block_size: BlockSize
    dp_rank: Rank | None = None
    replay_endpoint: EndpointText | None = None
    routing_group: Text = DEFAULT_GROUP


class UnregisterBody(msgspec.Struct, kw_only=True):
    """Dynamo's ``POST /unregister``."""

    instance_id: InstanceId
    model_name: Text
    routing_group: Text | None = None
    dp_rank: Rank | None = None


class QueryBody(msgspec.Struct, kw_only=True):
    """Dynamo's ``POST /query``."""

    token_ids: list[TokenId]
    model_name: Text
    routing_group: Text = DEFAULT_GROUP
    lora_name: Text | None = None
    cache_salt: CacheSalt | None = None


class QueryRest(QueryBody, kw_only=True):
    """``QueryBody`` with ``token_ids`` left as JSON text (packed apart, in one pass)."""

    # The one field whose type a subclass changes: msgspec decodes by this annotation, while
    # mypy holds an override to its base's type.
    token_ids: msgspec.Raw  # type: ignore[assignment]


_register = msgspec.json.Decoder(RegisterBody)
_unregister = msgspec.json.Decoder(UnregisterBody)
_query = msgspec.json.Decoder(QueryBody)
_query_rest = msgspec.json.Decoder(QueryRest)
_NULL = b"null"
_OK = {"status": "ok"}
_Body = TypeVar("_Body", RegisterBody, UnregisterBody, QueryBody, QueryRest)


def _decode(body: bytes, decoder: msgspec.json.Decoder[_Body], where: str) -> _Body:
    """Dynamo's statuses for a bad body: 400 when it is not JSON, 422 when its fields or
    types are wrong; the message names the field and the rule."""
    try:
        decoded = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{where}: {exc}", 422) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{where}: {exc}") from None
    except RecursionError:
        raise BadRequest(f"{where}: JSON is nested too deeply") from None
    instance = decoded.instance_id if isinstance(decoded, (RegisterBody, UnregisterBody)) else 0
    if instance > _U64:
        raise BadRequest(f"{where}: Expected `int` <= {_U64} - at `$.instance_id`", 422)
    return decoded


def _no_indexer(model: str, group: str) -> BadRequest:
    return BadRequest(f"no indexer for model={model} routing_group={group}", 404)


def _model_block_size(service: IndexService, model: str) -> int | None:
    """The block size of ``model``'s registered workers (Dynamo keeps one per model)."""
    return next((r.block_size for r in service.workers() if r.model_name == model), None)


def _serves(service: IndexService, model: str, group: str) -> bool:
    return group == DEFAULT_GROUP and _model_block_size(service, model) is not None


def dynamo_scores(match: MatchResult, sizes: dict[str, int]) -> JsonObject:
    """A match as Dynamo's ``/query`` reply: tokens (blocks x the worker's block size).

    ``scores`` are the device tier's; in ``instances``, ``cpu`` and ``disk`` count through
    the tiers above them (our holders are per tier: ``cpu`` is the longer of the device and
    host prefixes, ``disk`` the prefix on any tier).
    """
    gpu: dict[tuple[str, int], int] = {}
    cpu: dict[tuple[str, int], int] = {}
    for key, blocks in match.holders.items():
        target = (key.worker_id, key.rank)
        if key.tier == DEFAULT_TIER:
            gpu[target] = blocks
        elif key.tier in _CPU_TIERS:
            cpu[target] = blocks
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, JsonObject] = {}
    for (worker, rank), any_tier in match.streams.items():
        size = sizes.get(worker, 0)
        on_gpu = gpu.get((worker, rank), 0)
        if on_gpu:
            scores.setdefault(worker, {})[str(rank)] = on_gpu * size
        through_cpu = min(any_tier, max(on_gpu, cpu.get((worker, rank), 0)))
        _add_rank(instances, worker, rank, (on_gpu * size, through_cpu * size, any_tier * size))
    return {"scores": scores, "frequencies": [], "instances": instances}


def _add_rank(
    instances: dict[str, JsonObject], worker: str, rank: int, tokens: tuple[int, int, int]
) -> None:
    gpu, cpu, disk = tokens
    row = instances.setdefault(
        worker, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
    )
    row["dp"][str(rank)] = gpu
    row["gpu"] = max(row["gpu"], gpu)
    row["cpu"] = max(row["cpu"], cpu)
    row["disk"] = max(row["disk"], disk)
    row["longest_matched"] = max(row["gpu"], row["cpu"], row["disk"])


class DynamoQueryReader:
    """Turns a Dynamo ``POST /query`` body into Dynamo's reply (the :class:`~._query.QueryHandler`
    reader of ``--api dynamo``), or a BadRequest with Dynamo's status.

    With the native block table, ``token_ids`` are packed straight from the JSON text, as
    our own reader does; a body the packer does not take is decoded whole, which names what
    is wrong with it.
    """

    def __init__(self, service: IndexService) -> None:
        self.service = service
        self.pack_member = json_packers()[1]

    def answer(self, body: bytes) -> JsonObject:
        query, packed = self.read(body)
        if not _serves(self.service, query.model_name, query.routing_group):
            raise _no_indexer(query.model_name, query.routing_group)
        sizes = {r.worker_id: r.block_size for r in self.service.workers()}
        result: JsonObject = self.service.query(
            packed=packed,
            lora=query.lora_name,
            cache_salt=query.cache_salt,
            model_name=query.model_name,
            shape=lambda match, _decision: dynamo_scores(match, sizes),
        )
        return result

    def read(self, body: bytes) -> tuple[QueryBody, bytes]:
        """The decoded query and its tokens packed as uint32 little-endian."""
        found = None if self.pack_member is None else self.pack_member(body, b"token_ids")
        if found is not None:
            packed, start, end = found
            rest = _decode(body[:start] + _NULL + body[end:], _query_rest, "/query")
            if bytes(rest.token_ids) == _NULL:  # else a repeated member: decode it whole
                return rest, packed
        query = _decode(body, _query, "/query")
        return query, pack_tokens(query.token_ids)


class DynamoApi:
    """The Dynamo-shaped handlers of ``/register``, ``/unregister``, ``/workers`` and
    ``/query_by_hash`` (``/query`` is answered by :class:`DynamoQueryReader`)."""

    def __init__(
        self,
        service: IndexService,
        body: Callable[[Request], Awaitable[bytes]],
        check_endpoints: Callable[[WorkerRegistration], None],
    ) -> None:
        self.service = service
        self._body = body
        self._check_endpoints = check_endpoints

    async def register(self, request: Request) -> Response:
        body = _decode(await self._body(request), _register, "/register")
        if body.routing_group != DEFAULT_GROUP:
            raise BadRequest(f"/register: only the routing_group {DEFAULT_GROUP!r} is served", 422)
        reg = _registration(body)
        self._check_endpoints(reg)
        add = functools.partial(self.service.add_rank, replace=False, one_size_per_model=True)
        try:
            await run_in_threadpool(add, reg)
        except RegistrationConflict as exc:
            raise _conflict(exc, body) from None
        except LayoutError as exc:
            raise BadRequest(str(exc)) from None
        except StreamAddError as exc:
            raise BadRequest(str(exc), 409) from None
        return json_response(_OK, 201)

    async def unregister(self, request: Request) -> Response:
        body = _decode(await self._body(request), _unregister, "/unregister")
        worker = str(body.instance_id)
        reg = next((r for r in self.service.workers() if r.worker_id == worker), None)
        if reg is None:
            raise BadRequest(f"instance {worker} not found", 404)
        if reg.model_name != body.model_name:
            raise BadRequest(
                f"instance {worker} is registered for model={reg.model_name} "
                f"routing_group={DEFAULT_GROUP}",
                404,
            )
        # As Dynamo: a rank alone only within a named routing group; else the whole instance.
        rank = body.dp_rank if body.routing_group is not None else None
        if body.routing_group not in (None, DEFAULT_GROUP):
            raise BadRequest(f"instance {worker} not found", 404)
        if rank is not None and rank not in reg.ranks:
            raise BadRequest(f"instance {worker} dp_rank {rank} not found", 404)
        await run_in_threadpool(self.service.unregister, worker, rank)
        return json_response(_OK, 200)

    async def workers(self, request: Request) -> Response:
        model = request.query_params.get("model_name")
        regs = [r for r in self.service.workers() if model in (None, r.model_name)]
        return json_response([self._worker(reg) for reg in regs])

    def _worker(self, reg: WorkerRegistration) -> JsonObject:
        endpoints = {str(s.rank): s.endpoint for s in self.service.stream_specs(reg)}
        return {
            "instance_id": _instance_id(reg.worker_id),
            "source": "zmq",
            "status": "active",
            "model_name": reg.model_name,
            "routing_group": DEFAULT_GROUP,
            "block_size": reg.block_size,
            "endpoints": endpoints,
            "listeners": {
                rank: {"endpoint": endpoint, "status": "active"}
                for rank, endpoint in endpoints.items()
            },
        }

    async def query_by_hash(self, request: Request) -> Response:
        raise BadRequest(
            "/query_by_hash takes Dynamo's own block hashes, which this index does not keep "
            "(it keys blocks by its own chained hashes): query by token_ids with /query",
            501,
        )


def _instance_id(worker_id: str) -> int | str:
    """A worker id as Dynamo's ``/workers`` shows it: the u64 it spells when it spells one
    the usual way (ASCII digits, no leading zero), else the id as it is. Not
    ``str.isdigit``: it takes "²", which ``int`` refuses, and the Arabic-Indic one, which it
    reads as 1."""
    if worker_id.isascii() and worker_id.isdigit() and len(worker_id) <= len(str(_U64)):
        value = int(worker_id)
        if value <= _U64 and str(value) == worker_id:
            return value
    return worker_id


def _registration(body: RegisterBody) -> WorkerRegistration:
    rank = body.dp_rank if body.dp_rank is not None else 0
    return WorkerRegistration(
        worker_id=str(body.instance_id),
        endpoint=body.endpoint,
        block_size=body.block_size,
        ranks=(rank,),
        replay_endpoint=body.replay_endpoint,
        model_name=body.model_name,
        own_endpoints=(OwnEndpoints(rank, body.endpoint, body.replay_endpoint),),
    )


def _block_size_conflict(model: str, existing: int, requested: int) -> BadRequest:
    return BadRequest(
        f"block_size mismatch for model={model} routing_group={DEFAULT_GROUP}: "
        f"existing={existing}, requested={requested}",
        409,
    )


def _conflict(exc: RegistrationConflict, body: RegisterBody) -> BadRequest:
    """A refused rank in Dynamo's words (a 409)."""
    if exc.field == "rank":
        return BadRequest(f"instance {exc.worker_id} dp_rank {exc.rank} already registered", 409)
    if exc.field == "model_name":
        return BadRequest(
            f"instance {exc.worker_id} is already registered for "
            f"model={exc.existing} routing_group={DEFAULT_GROUP}",
            409,
        )
    return _block_size_conflict(body.model_name, int(str(exc.existing)), body.block_size)
