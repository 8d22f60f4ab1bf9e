"""``KVEventsConfig`` (WIRE.md section 1) and the per-rank layout it implies (section 5).

Exactly the eight fields of TensorRT-LLM's and vLLM's model, with the same defaults. Anything
kvevents adds (heartbeats, replay byte budget, linger) lives in ``PublisherOptions`` so that
every config TensorRT-LLM accepts keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvevents.errors import LayoutError
from kvevents.wire.endpoints import (
    MAX_PORT,
    Endpoint,
    layout_error,
    parse_endpoint,
    rank_endpoint,
)

__all__ = ["KVEventsConfig", "RankEndpoints", "check_layout", "rank_endpoints"]


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
        if value is not None:
            try:
                parse_endpoint(value)
            except LayoutError as exc:
                raise ValueError(f"{exc} (rule: {exc.rule})") from None
        return value

    @property
    def publishing(self) -> bool:
        """True when this config asks for a real (ZeroMQ) publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


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
