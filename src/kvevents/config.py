"""``KVEventsConfig``: the configuration users already know (WIRE.md section 1).

Exactly the eight fields of TensorRT-LLM's and vLLM's model, with the same defaults. Anything
kvevents adds (heartbeats, replay byte budget, linger) lives in ``PublisherOptions`` so that
every config TensorRT-LLM accepts keeps its meaning.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .endpoints import parse_endpoint
from .errors import LayoutError

__all__ = ["KVEventsConfig"]


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
