"""``KVEventsConfig`` (WIRE.md section 1) and the per-rank layout it implies (section 5).

Exactly the eight fields of TensorRT-LLM's and vLLM's model, with the same defaults. Anything
kvevents adds (heartbeats, replay byte budget, linger) lives in ``PublisherOptions`` so that
every config TensorRT-LLM accepts keeps its meaning.

SGLang's ``--kv-events-config`` is another dialect of the same settings (no
``enable_kv_cache_events``: giving the config enables it; plus ``bind`` and ``format``).
:class:`SGLangKVEventsConfig` reads it as strictly as ``KVEventsConfig`` reads its own, and
``to_kvevents()`` maps it onto ours; :func:`read_kv_events_config` takes either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from kvevents._types import DocumentView
from kvevents.errors import LayoutError
from kvevents.wire import MAX_PORT, Endpoint, layout_error, parse_endpoint, rank_endpoint

__all__ = [
    "SGLANG_PUBLISHERS",
    "KVEventsConfig",
    "RankEndpoints",
    "SGLangKVEventsConfig",
    "check_layout",
    "rank_endpoints",
    "read_kv_events_config",
]


def _checked_endpoint(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_endpoint(value)
        except LayoutError as exc:
            raise ValueError(f"{exc} (rule: {exc.rule})") from None
    return value


class KVEventsConfig(BaseModel):
    """Configuration of KV cache event publishing for one engine (all of its ranks).

    Strict: unknown fields are rejected, types are not coerced, and every violation raises
    ``pydantic.ValidationError`` naming the field. Round-trips through JSON, which is the form
    engines accept on their command line (``--kv-events-config '{...}'``).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)

    enable_kv_cache_events: bool = Field(
        default=False, description="Produce and publish KV cache events over the push path."
    )
    publisher: Literal["null", "zmq"] | None = Field(
        default=None,
        description='Publisher kind. None resolves to "zmq" when events are enabled, else '
        '"null"; an explicit value is kept as given.',
    )
    endpoint: str = Field(
        default="tcp://*:5557",
        min_length=1,
        description="Base endpoint the publisher binds; attention-DP rank r binds base port + r "
        "(ipc/inproc: suffix _dp<r> for r > 0).",
    )
    replay_endpoint: str | None = Field(
        default=None,
        min_length=1,
        description="Base endpoint of the replay (ROUTER) socket, same per-rank rule. None: no replay.",
    )
    buffer_steps: int = Field(
        default=10000, gt=0, description="Number of published batches kept for replay."
    )
    hwm: int = Field(
        default=100000,
        gt=0,
        description="ZeroMQ high-water mark of the publisher socket (0 would mean unlimited).",
    )
    max_queue_size: int = Field(
        default=100000,
        gt=0,
        description="Maximum number of batches waiting to be published (0 would be unbounded).",
    )
    topic: str = Field(
        default="", description="First frame of every message; subscribers filter by byte prefix."
    )

    @field_validator("publisher", mode="after")
    @classmethod
    def _resolve_publisher(
        cls, value: Literal["null", "zmq"] | None, info: ValidationInfo
    ) -> Literal["null", "zmq"]:
        if value is not None:
            return value
        return "zmq" if info.data.get("enable_kv_cache_events") else "null"

    @field_validator("endpoint", "replay_endpoint", mode="after")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        return _checked_endpoint(value)

    @property
    def publishing(self) -> bool:
        """True when this config asks for a real (ZeroMQ) publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


#: The ``publisher`` names of SGLang's config that kvevents can stand for: its no-op, its own
#: ZeroMQ publisher (the same wire) and the kvevents plugin (``kvevents.integrations.sglang``).
SGLANG_PUBLISHERS = ("null", "zmq", "kvevents")
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]"})


class SGLangKVEventsConfig(BaseModel):
    """SGLang's ``--kv-events-config`` JSON, read as strictly as :class:`KVEventsConfig`.

    SGLang's fields with SGLang's defaults. Unknown fields, values of the wrong type and
    settings kvevents cannot honour are ``pydantic.ValidationError`` naming the field and the
    rule (SGLang itself ignores unknown fields: a typo there silently keeps the default).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)

    publisher: str = Field(
        default="null",
        description=f"SGLang's publisher name, one of {', '.join(SGLANG_PUBLISHERS)}; "
        '"null" publishes nothing.',
    )
    endpoint: str = Field(
        default="tcp://*:5557", min_length=1, description="Base endpoint of the PUB socket."
    )
    bind: bool | None = Field(
        default=None,
        description="SGLang: bind (true) or connect (false) the PUB socket; unset binds a "
        "wildcard host, ipc or inproc and connects a concrete host. kvevents only binds.",
    )
    replay_endpoint: str | None = Field(
        default=None, min_length=1, description="Base endpoint of the replay ROUTER socket."
    )
    buffer_steps: int = Field(default=10000, gt=0, description="Batches kept for replay.")
    hwm: int = Field(default=100000, gt=0, description="High-water mark of the PUB socket.")
    max_queue_size: int = Field(
        default=100000, gt=0, description="Batches that may wait to be published."
    )
    topic: str = Field(default="", description="First frame of every message.")
    format: Literal["default", "dynamo"] = Field(
        default="default",
        description='How SGLang computes block hashes ("dynamo": namespaced by extra key and '
        "cache salt); both are the same msgpack wire, so the publisher never sees it.",
    )

    @field_validator("publisher", mode="after")
    @classmethod
    def _check_publisher(cls, value: str) -> str:
        if value not in SGLANG_PUBLISHERS:
            raise ValueError(
                f"publisher {value!r} is not one kvevents can stand for; use one of "
                f"{', '.join(SGLANG_PUBLISHERS)}"
            )
        return value

    @field_validator("endpoint", "replay_endpoint", mode="after")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        return _checked_endpoint(value)

    @field_validator("bind", mode="after")
    @classmethod
    def _check_bind(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        endpoint = info.data.get("endpoint")
        if endpoint is None or _sglang_binds(endpoint, value):
            return value  # an invalid endpoint has its own error
        why = "bind is false" if value is False else "a concrete host and no bind"
        raise ValueError(
            f"SGLang would connect the PUB socket to {endpoint} ({why}); the kvevents "
            "publisher only binds: set bind to true to bind that address, or use a wildcard "
            "host (tcp://*:PORT)"
        )

    def to_kvevents(self) -> KVEventsConfig:
        """The same settings as a :class:`KVEventsConfig` (publishing unless ``"null"``)."""
        return KVEventsConfig(
            enable_kv_cache_events=self.publisher != "null",
            publisher="null" if self.publisher == "null" else "zmq",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
            max_queue_size=self.max_queue_size,
            topic=self.topic,
        )


def _sglang_binds(endpoint: str, bind: bool | None) -> bool:
    """Whether SGLang's own publisher binds ``endpoint``: ``bind`` when set, else by its rule
    (a wildcard host, ipc and inproc bind; a concrete tcp host connects)."""
    if bind is not None:
        return bind
    scheme, _, rest = endpoint.partition("://")
    return scheme != "tcp" or rest.rpartition(":")[0] in _WILDCARD_HOSTS


def read_kv_events_config(data: str | bytes | DocumentView) -> KVEventsConfig:
    """A ``--kv-events-config`` value in either dialect, as a :class:`KVEventsConfig`.

    A config with ``enable_kv_cache_events`` is kvevents' (and vLLM's, TensorRT-LLM's) dialect;
    one without it is SGLang's, which has no such field. Either is checked strictly: a field of
    the other dialect is an unknown field, named in the ``pydantic.ValidationError``.
    """
    if isinstance(data, Mapping):
        fields = dict(data)
    else:
        fields = json.loads(data)
        if not isinstance(fields, dict):
            raise ValueError(f"a KV events config is a JSON object, not {type(fields).__name__}")
    if "enable_kv_cache_events" in fields:
        return KVEventsConfig.model_validate(fields)
    return SGLangKVEventsConfig.model_validate(fields).to_kvevents()


@dataclass(frozen=True)
class RankEndpoints:
    """The endpoints one rank binds: ``publish`` always, ``replay`` when replay is on."""

    rank: int
    publish: str
    replay: str | None


def rank_endpoints(config: KVEventsConfig, rank: int) -> RankEndpoints:
    """The publish and replay endpoints of ``rank`` under ``config``."""
    replay = None if config.replay_endpoint is None else rank_endpoint(config.replay_endpoint, rank)
    return RankEndpoints(rank=rank, publish=rank_endpoint(config.endpoint, rank), replay=replay)


def _check_range(endpoint: str, parsed: Endpoint, world_size: int) -> None:
    if parsed.scheme != "tcp" or parsed.is_ephemeral:
        return
    last = parsed.port + world_size - 1
    if last > MAX_PORT:
        raise layout_error(
            endpoint,
            "range",
            f"ports {parsed.port}..{last} for {world_size} ranks exceed {MAX_PORT}",
            world_size - 1,
        )


def check_layout(
    config: KVEventsConfig, world_size: int = 1, ranks_per_host: int | None = None
) -> list[RankEndpoints]:
    """Check the whole layout for ``world_size`` ranks and return every rank's endpoints.

    ``ranks_per_host`` is how many ranks share one host (default: all of them). Every rank
    calls this with the same arguments and gets the same answer, before any socket exists.
    """
    if world_size < 1:
        raise layout_error(
            config.endpoint, "world_size", f"world size must be >= 1, got {world_size}"
        )
    if ranks_per_host is not None and ranks_per_host < 1:
        raise layout_error(
            config.endpoint, "ranks_per_host", f"ranks per host must be >= 1, got {ranks_per_host}"
        )
    publish = parse_endpoint(config.endpoint)
    _check_range(config.endpoint, publish, world_size)
    if config.replay_endpoint is not None:
        replay = parse_endpoint(config.replay_endpoint)
        _check_range(config.replay_endpoint, replay, world_size)
        _check_spacing(
            config.endpoint,
            publish,
            config.replay_endpoint,
            replay,
            min(world_size, ranks_per_host or world_size),
        )
    return [rank_endpoints(config, rank) for rank in range(world_size)]


def _check_spacing(
    pub_text: str, publish: Endpoint, replay_text: str, replay: Endpoint, per_host: int
) -> None:
    if publish.scheme == "tcp" and replay.scheme == "tcp":
        if publish.is_ephemeral or replay.is_ephemeral:
            return
        if abs(replay.port - publish.port) < per_host:
            raise layout_error(
                replay_text,
                "spacing",
                f"replay base port {replay.port} is within {per_host} of publish base port "
                f"{publish.port} ({pub_text}): with {per_host} ranks per host their ranges collide",
            )
    elif publish.scheme == replay.scheme and publish.path == replay.path:
        raise layout_error(
            replay_text, "spacing", f"replay endpoint equals publish endpoint {pub_text}"
        )
