"""Endpoint parsing and the per-rank endpoint layout (WIRE.md section 5).

Pure functions, no sockets: every rank of an engine computes the same layout and fails the
same way before any socket exists.

- ``tcp://HOST:PORT``: rank r uses ``PORT + r``. HOST is ``*``, an IPv4 address, ``[IPv6]``
  or a name. Port 0 is an extension for tests: every rank binds an ephemeral port, read back
  from the bound socket.
- ``ipc://PATH`` and ``inproc://NAME``: rank 0 uses the endpoint as given, rank r > 0 appends
  ``_dp<r>``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import LayoutError

if TYPE_CHECKING:
    from .config import KVEventsConfig

__all__ = [
    "Endpoint",
    "RankEndpoints",
    "check_layout",
    "parse_endpoint",
    "rank_endpoint",
    "rank_endpoints",
]

MAX_PORT = 65535
_SCHEMES = ("tcp", "ipc", "inproc")
# RFC 1123 host names, plus the interface names ZeroMQ accepts for bind (eth0, lo).
_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_-]{1,63})*$")
_IPV4_LIKE = re.compile(r"^[0-9.]+$")


@dataclass(frozen=True)
class Endpoint:
    """A parsed ZeroMQ endpoint. ``host``/``port`` are set for tcp, ``path`` otherwise."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def is_ipv6(self) -> bool:
        """True for a bracketed IPv6 host, which needs the socket's IPv6 option."""
        return self.host.startswith("[")

    @property
    def is_ephemeral(self) -> bool:
        """True for ``tcp://HOST:0``: the operating system picks the port."""
        return self.scheme == "tcp" and self.port == 0

    def for_rank(self, rank: int) -> str:
        """The endpoint rank ``rank`` uses, as a string."""
        if self.scheme == "tcp":
            port = 0 if self.is_ephemeral else self.port + rank
            return f"tcp://{self.host}:{port}"
        suffix = f"_dp{rank}" if rank > 0 else ""
        return f"{self.scheme}://{self.path}{suffix}"


def _fail(endpoint: str, rule: str, detail: str, rank: int | None = None) -> LayoutError:
    who = "" if rank is None else f" for rank {rank}"
    return LayoutError(
        f"endpoint {endpoint!r}{who}: {detail}", endpoint=endpoint, rank=rank, rule=rule
    )


def _check_host(endpoint: str, host: str) -> None:
    if host == "*":
        return
    if host.startswith("["):
        if not host.endswith("]"):
            raise _fail(endpoint, "host", "IPv6 host must be enclosed in brackets, e.g. [::1]")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _fail(endpoint, "host", f"{host} is not an IPv6 address") from None
        return
    if _IPV4_LIKE.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _fail(endpoint, "host", f"{host} is not an IPv4 address") from None
        return
    if ":" in host:
        raise _fail(endpoint, "host", "IPv6 host must be enclosed in brackets, e.g. [::1]")
    if not _NAME.match(host):
        raise _fail(endpoint, "host", f"{host!r} is not '*', an IPv4 address, [IPv6] or a name")


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parse and check one endpoint string; raise :class:`LayoutError` naming the rule."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise _fail(endpoint, "scheme", f"scheme must be one of {', '.join(_SCHEMES)}")
    if scheme != "tcp":
        if not rest:
            raise _fail(endpoint, "path", f"{scheme} endpoint needs a path or name")
        return Endpoint(scheme=scheme, path=rest)
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host:
        raise _fail(endpoint, "port", "tcp endpoint needs HOST:PORT with a numeric port")
    if not port_text.isdigit() or not port_text.isascii():
        raise _fail(endpoint, "port", f"port {port_text!r} is not numeric")
    port = int(port_text)
    if port > MAX_PORT:
        raise _fail(endpoint, "port", f"port {port} is out of range 1..{MAX_PORT}")
    _check_host(endpoint, host)
    return Endpoint(scheme="tcp", host=host, port=port)


def rank_endpoint(base: str, rank: int) -> str:
    """The endpoint that attention-DP rank ``rank`` binds, from the base endpoint."""
    if rank < 0:
        raise _fail(base, "rank", f"rank must be >= 0, got {rank}", rank)
    parsed = parse_endpoint(base)
    if parsed.scheme == "tcp" and not parsed.is_ephemeral and parsed.port + rank > MAX_PORT:
        raise _fail(base, "range", f"port {parsed.port} + rank {rank} exceeds {MAX_PORT}", rank)
    return parsed.for_rank(rank)


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
        raise _fail(
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
        raise _fail(config.endpoint, "world_size", f"world size must be >= 1, got {world_size}")
    if ranks_per_host is not None and ranks_per_host < 1:
        raise _fail(
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
            raise _fail(
                replay_text,
                "spacing",
                f"replay base port {replay.port} is within {per_host} of publish base port "
                f"{publish.port} ({pub_text}): with {per_host} ranks per host their ranges collide",
            )
    elif publish.scheme == replay.scheme and publish.path == replay.path:
        raise _fail(replay_text, "spacing", f"replay endpoint equals publish endpoint {pub_text}")
