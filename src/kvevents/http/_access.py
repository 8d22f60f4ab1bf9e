"""Who may change the service, and where it may be told to connect. Pure: no sockets.

- :class:`TokenCheck`: a bearer token for the mutating endpoints (``/register``,
  ``/unregister``), optionally for the read-only ones too, compared in constant time.
- :class:`EndpointPolicy`: the hosts a registration may point the subscriber at. Without it
  anyone who can reach the HTTP port could make the router open connections anywhere its
  network reaches (a scanner, or a loop into its own HTTP port). The default allows loopback
  only; ``--allow-endpoint-host`` widens it by name, address or CIDR.

See docs/security.md for the threat model.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvevents.errors import LayoutError
from kvevents.files import read_bounded
from kvevents.wire.endpoints import parse_endpoint, rank_endpoint

__all__ = [
    "ACCESS_RULES",
    "DEFAULT_ALLOWED_HOSTS",
    "MAX_TOKEN_BYTES",
    "TOKEN_ENV",
    "EndpointPolicy",
    "TokenCheck",
    "exposed_mode",
    "is_loopback",
    "load_token",
]

#: The environment variable ``kvevents serve`` reads the token from (no file given).
TOKEN_ENV = "KVEVENTS_AUTH_TOKEN"
#: The largest token file read: a bearer token is tens of bytes.
MAX_TOKEN_BYTES = 4096
#: Loopback only: a registration over HTTP cannot reach another host unless allowed.
DEFAULT_ALLOWED_HOSTS = ("127.0.0.0/8", "::1", "localhost")
#: The allow-list entry that admits ``ipc://`` endpoints (local Unix sockets).
IPC = "ipc"
#: The ``LayoutError.rule`` of an endpoint refused by the policy (not malformed: forbidden).
ACCESS_RULES = frozenset({"allowed_host", "own_port"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address) is reachable from this machine only: an address
    in ``127.0.0.0/8`` or ``::1``, or ``localhost``. Any other name may resolve anywhere."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token in ``path`` (surrounding whitespace stripped), else in ``$KVEVENTS_AUTH_TOKEN``;
    None when neither is set. An empty token is refused: it would let everyone in. The file
    is read as :func:`kvevents.files.read_bounded` reads (OSError for a device, a directory
    or over :data:`MAX_TOKEN_BYTES`)."""
    env = os.environ if environ is None else environ
    token = _token_file(path) if path is not None else env.get(TOKEN_ENV)
    if token is None:
        return None
    if not token.strip():
        where = path if path is not None else f"${TOKEN_ENV}"
        raise ValueError(f"{where}: the auth token is empty")
    return token.strip()


def _token_file(path: str) -> str:
    data = read_bounded(path, MAX_TOKEN_BYTES, "token file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the auth token is not UTF-8 text") from None


def exposed_mode(path: str) -> int | None:
    """The permission bits of the token file ``path`` when its group or anyone else may read
    it (then anyone with an account on the machine can change the service); None otherwise."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    return mode if mode & (stat.S_IRGRP | stat.S_IROTH) else None


@dataclass(frozen=True)
class TokenCheck:
    """Bearer-token authentication. ``token`` None: nothing is checked.

    ``protect_reads``: the read-only endpoints need the token too (they are open by default:
    they reveal which prefixes are cached where, but change nothing).
    """

    token: str | None = None
    protect_reads: bool = False

    def required(self, mutating: bool) -> bool:
        """Whether a request to a mutating (or read-only) endpoint must carry the token."""
        return self.token is not None and (mutating or self.protect_reads)

    def allows(self, headers: Iterable[tuple[bytes, bytes]], mutating: bool) -> bool:
        """Whether a request with ``headers`` (names lower case) may reach a mutating (or a
        read-only) endpoint: it needs no token there, or its ``Authorization`` carries it."""
        if not self.required(mutating):
            return True
        return self.accepts(next((v for k, v in headers if k == b"authorization"), None))

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries the token (constant time)."""
        if self.token is None:
            return True
        scheme, _, given = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(given.strip(), self.token.encode())


def _entry(text: str) -> Network | str:
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        return text.lower()


@dataclass(frozen=True)
class EndpointPolicy:
    """Which endpoint hosts a registration may name.

    ``hosts``: addresses, CIDRs (``10.0.0.0/8``), host names (matched literally, case aside:
    a name is never resolved here, so what is allowed is what was written), ``*`` for any
    host, ``ipc`` to admit ``ipc://`` endpoints. ``forbidden_ports``: ports never connected
    to on a local or allowed host (the service's own HTTP port).
    """

    hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS
    forbidden_ports: frozenset[int] = frozenset()
    _entries: tuple[Network | str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_entries", tuple(_entry(h) for h in self.hosts))

    def with_forbidden_port(self, port: int) -> EndpointPolicy:
        """The same policy, also refusing ``port``."""
        return EndpointPolicy(self.hosts, self.forbidden_ports | {port})

    def check(self, field_name: str, endpoint: str, ranks: Iterable[int]) -> None:
        """Raise ``LayoutError`` unless every rank's endpoint derived from the base
        ``endpoint`` may be connected to: its ``rule`` is one of :data:`ACCESS_RULES` when the
        policy forbids it, a layout rule when it is malformed."""
        for rank in ranks:
            self._check_one(field_name, rank_endpoint(endpoint, rank))

    def _check_one(self, field_name: str, endpoint: str) -> None:
        parsed = parse_endpoint(endpoint)
        if parsed.scheme != "tcp":
            if parsed.scheme == IPC and IPC in self._entries:
                return
            raise _refused(field_name, endpoint, f"{parsed.scheme}:// endpoints", self.hosts)
        host = parsed.host.strip("[]").lower()
        if not self._host_allowed(host):
            raise _refused(field_name, endpoint, f"host {parsed.host}", self.hosts)
        if parsed.port in self.forbidden_ports:
            raise LayoutError(
                f"endpoint {endpoint!r} is this service's own HTTP port - at `$.{field_name}`",
                endpoint=endpoint,
                rank=None,
                rule="own_port",
            )

    def _host_allowed(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host in self._entries or "*" in self._entries
        if "*" in self._entries:
            return True
        return any(not isinstance(e, str) and address in e for e in self._entries)


def _refused(field_name: str, endpoint: str, what: str, hosts: tuple[str, ...]) -> LayoutError:
    return LayoutError(
        f"endpoint {endpoint!r}: {what} not allowed (allowed: {', '.join(hosts)}; "
        f"see --allow-endpoint-host) - at `$.{field_name}`",
        endpoint=endpoint,
        rank=None,
        rule="allowed_host",
    )
