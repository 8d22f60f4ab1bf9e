"""Endpoint strings and their per-rank form (WIRE.md section 5).

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
import sys
from dataclasses import dataclass

from kvevents.errors import LayoutError

__all__ = [
    "MAX_IPC_PATH",
    "MAX_PORT",
    "Endpoint",
    "layout_error",
    "parse_endpoint",
    "rank_endpoint",
]

MAX_PORT = 65535
#: The longest ``ipc://`` path in bytes: a Unix socket address holds 108 bytes on Linux and
#: 104 on macOS, the terminating NUL included. ZeroMQ refuses longer paths when the socket
#: connects or binds, on the I/O thread, far from the code that chose the path.
MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107
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


def layout_error(endpoint: str, rule: str, detail: str, rank: int | None = None) -> LayoutError:
    who = "" if rank is None else f" for rank {rank}"
    return LayoutError(
        f"endpoint {endpoint!r}{who}: {detail}", endpoint=endpoint, rank=rank, rule=rule
    )


def _check_host(endpoint: str, host: str) -> None:
    if host == "*":
        return
    if host.startswith("["):
        if not host.endswith("]"):
            raise layout_error(
                endpoint, "host", "IPv6 host must be enclosed in brackets, e.g. [::1]"
            )
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise layout_error(endpoint, "host", f"{host} is not an IPv6 address") from None
        return
    if _IPV4_LIKE.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise layout_error(endpoint, "host", f"{host} is not an IPv4 address") from None
        return
    if ":" in host:
        raise layout_error(endpoint, "host", "IPv6 host must be enclosed in brackets, e.g. [::1]")
    if not _NAME.match(host):
        raise layout_error(
            endpoint, "host", f"{host!r} is not '*', an IPv4 address, [IPv6] or a name"
        )


def _check_ipc_path(endpoint: str, path: str) -> None:
    size = len(path.encode())
    if size > MAX_IPC_PATH:
        raise layout_error(
            endpoint,
            "path",
            f"ipc path is {size} bytes; a Unix socket path holds at most {MAX_IPC_PATH}",
        )


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parse and check one endpoint string; raise :class:`LayoutError` naming the rule."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise layout_error(endpoint, "scheme", f"scheme must be one of {', '.join(_SCHEMES)}")
    if scheme != "tcp":
        if not rest:
            raise layout_error(endpoint, "path", f"{scheme} endpoint needs a path or name")
        if scheme == "ipc":
            _check_ipc_path(endpoint, rest)
        return Endpoint(scheme=scheme, path=rest)
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host:
        raise layout_error(endpoint, "port", "tcp endpoint needs HOST:PORT with a numeric port")
    if not port_text.isdigit() or not port_text.isascii():
        raise layout_error(endpoint, "port", f"port {port_text!r} is not numeric")
    port = int(port_text)
    if port > MAX_PORT:
        raise layout_error(endpoint, "port", f"port {port} is out of range 1..{MAX_PORT}")
    _check_host(endpoint, host)
    return Endpoint(scheme="tcp", host=host, port=port)


def rank_endpoint(base: str, rank: int) -> str:
    """The endpoint that attention-DP rank ``rank`` binds, from the base endpoint."""
    if rank < 0:
        raise layout_error(base, "rank", f"rank must be >= 0, got {rank}", rank)
    parsed = parse_endpoint(base)
    if parsed.scheme == "tcp" and not parsed.is_ephemeral and parsed.port + rank > MAX_PORT:
        raise layout_error(
            base, "range", f"port {parsed.port} + rank {rank} exceeds {MAX_PORT}", rank
        )
    ranked = parsed.for_rank(rank)
    size = len(ranked.encode()) - len("ipc://")
    if parsed.scheme == "ipc" and size > MAX_IPC_PATH:  # the rank suffix can push it over
        raise layout_error(
            ranked,
            "path",
            f"ipc path is {size} bytes; a Unix socket path holds at most {MAX_IPC_PATH}",
            rank,
        )
    return ranked
