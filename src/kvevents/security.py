"""Opt-in CurveZMQ authentication and encryption of kvevents streams (``docs/security.md``).

Token ids are user prompt content. With :class:`CurveServer` in ``PublisherOptions.curve`` the
PUB and replay ROUTER sockets of a publisher become CURVE servers: every byte on the wire is
encrypted and authenticated, subscribers must know the publisher's public key, and an optional
allow-list restricts which client keys may connect. Subscribers pass a :class:`CurveClient`
(per ``StreamSpec`` or as the ``SubscriberOptions`` default). Without them the wire is exactly
the plain one every engine speaks.

Keys are Z85 text (40 characters). Key files use ZeroMQ's certificate format
(``zmq.auth.load_certificate`` reads them): ``NAME.key`` holds the public key,
``NAME.key_secret`` both keys and is created with mode 0600, never through a symlink.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from kvevents._libzmq import Context, Socket
from kvevents.ratelimit import RateLimitedWarning

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "CurveClient",
    "CurveServer",
    "HandshakeWatch",
    "KeyPair",
    "apply_client",
    "apply_server",
    "generate_keypair",
    "load_keypair",
    "load_public_key",
    "load_public_keys",
    "monitor",
    "save_keypair",
    "start_authenticator",
]

logger = logging.getLogger("kvevents.publish.publisher")
security_logger = logging.getLogger("kvevents.security")

ZAP_DOMAIN = "kvevents"
_Z85 = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def _check_key(key: str, what: str) -> None:
    if not isinstance(key, str) or len(key) != 40 or not set(key) <= _Z85:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {_describe(key)}")


def _describe(key: object) -> str:
    if isinstance(key, str):
        return f"{len(key)} characters"
    return type(key).__name__


def _check_pair(public_key: str, secret_key: str, what: str) -> None:
    _check_key(public_key, f"{what} public key")
    _check_key(secret_key, f"{what} secret key")
    if zmq.curve_public(secret_key.encode()).decode() != public_key:
        raise ValueError(f"{what} public key does not belong to its secret key")


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 text. The secret key is left out of ``repr``."""

    public_key: str
    secret_key: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_pair(self.public_key, self.secret_key, "key pair")


def generate_keypair() -> KeyPair:
    """A new random key pair."""
    public, secret = zmq.curve_keypair()
    return KeyPair(public.decode(), secret.decode())


@dataclass(frozen=True)
class CurveServer:
    """A publisher's CURVE identity, and the client keys it admits (None: any client key).

    With ``allowed_clients`` a ZAP handler checks every client's public key during the
    handshake; a client not on the list is refused and counted in ``auth_rejected``.
    """

    secret_key: str = field(repr=False)
    public_key: str
    allowed_clients: frozenset[str] | None = None

    def __post_init__(self) -> None:
        _check_pair(self.public_key, self.secret_key, "server")
        if self.allowed_clients is not None:
            object.__setattr__(self, "allowed_clients", frozenset(self.allowed_clients))
            for key in self.allowed_clients:
                _check_key(key, "allowed client key")

    @classmethod
    def from_files(
        cls, secret_file: str | os.PathLike[str], allow_dir: str | os.PathLike[str] | None = None
    ) -> CurveServer:
        """The server in ``secret_file``; with ``allow_dir``, only the clients whose ``*.key``
        files are there may connect."""
        pair = load_keypair(secret_file)
        allowed = None if allow_dir is None else load_public_keys(allow_dir)
        return cls(pair.secret_key, pair.public_key, allowed)


@dataclass(frozen=True)
class CurveClient:
    """What a subscriber needs to read a CURVE publisher: its public key and a key pair.

    The client's own pair matters only to a publisher with an allow-list; otherwise
    :meth:`for_server` makes a fresh one.
    """

    server_key: str
    public_key: str
    secret_key: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_key(self.server_key, "server key")
        _check_pair(self.public_key, self.secret_key, "client")

    @classmethod
    def for_server(cls, server_key: str, pair: KeyPair | None = None) -> CurveClient:
        """A client of ``server_key`` with ``pair`` (default: a new random pair)."""
        pair = pair or generate_keypair()
        return cls(server_key, pair.public_key, pair.secret_key)

    @classmethod
    def from_files(
        cls,
        server_key_file: str | os.PathLike[str],
        secret_file: str | os.PathLike[str] | None = None,
    ) -> CurveClient:
        """A client of the server whose public key is in ``server_key_file``, with the key
        pair of ``secret_file`` (default: a new random pair)."""
        pair = None if secret_file is None else load_keypair(secret_file)
        return cls.for_server(load_public_key(server_key_file), pair)


# ---------------------------------------------------------------------- key files


def save_keypair(directory: str | os.PathLike[str], name: str = "kvevents") -> tuple[Path, Path]:
    """Create ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) with a new pair.

    Refuses to overwrite existing files and never writes through a symlink, even a dangling
    one (the files are created with ``O_EXCL | O_NOFOLLOW``). Returns (public file, secret file).
    """
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_file, secret_file):
        if os.path.lexists(path):
            raise FileExistsError(_exists_message(path))
    pair = generate_keypair()
    _create(secret_file, _certificate(pair, secret=True), 0o600)
    try:
        _create(public_file, _certificate(pair, secret=False), 0o644)
    except BaseException:
        os.unlink(secret_file)  # ours: created above, so no half-written pair is left behind
        raise
    return public_file, secret_file


def _exists_message(path: Path) -> str:
    kind = "a symlink" if path.is_symlink() else "a file"
    return f"{path} already exists ({kind}): not overwriting a key"


def _create(path: Path, text: str, mode: int) -> None:
    # O_EXCL fails on any existing name, a dangling symlink included, and O_NOFOLLOW makes sure
    # of it: a key is never written through a link to somewhere else. The mode is set on the
    # new file itself, so a secret is never readable by others, not even for a moment.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
    except FileExistsError:
        raise FileExistsError(_exists_message(path)) from None
    with os.fdopen(fd, "w", encoding="ascii") as out:
        os.fchmod(out.fileno(), mode)  # the umask may have taken bits away; never added any
        out.write(text)


def _certificate(pair: KeyPair, *, secret: bool) -> str:
    """ZeroMQ's certificate format (readable by ``zmq.auth.load_certificate`` and czmq)."""
    kind = "secret" if secret else "public"
    lines = [
        f"#   kvevents CURVE {kind} key (ZeroMQ certificate format)",
        "#   keep it private: whoever reads it is the publisher"
        if secret
        else "#   give it to the subscribers of the publisher that holds the secret",
        "",
        "metadata",
        "curve",
        f'    public-key = "{pair.public_key}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{pair.secret_key}"')
    return "\n".join(lines) + "\n"


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair in a secret certificate file (``NAME.key_secret``).

    A file that the group or others may read still loads, with a warning naming it and the fix.
    """
    public, secret = _read_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
    _warn_if_exposed(path)
    return KeyPair(public, secret)


def _warn_if_exposed(path: str | os.PathLike[str]) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        security_logger.warning(
            "secret key file %s is readable by %s (mode %03o): run `chmod 600 %s`",
            path,
            "others" if mode & 0o007 else "its group",
            mode,
            path,
        )


def load_public_key(path: str | os.PathLike[str]) -> str:
    """The public key in a certificate file (``NAME.key`` or ``NAME.key_secret``)."""
    return _read_certificate(path)[0]


def load_public_keys(directory: str | os.PathLike[str]) -> frozenset[str]:
    """The public keys of every ``*.key`` file in ``directory`` (an allow-list)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory of public key files")
    keys = frozenset(load_public_key(path) for path in sorted(folder.glob("*.key")))
    if not keys:
        raise ValueError(f"{folder} holds no *.key file: the allow-list would admit nobody")
    return keys


def _read_certificate(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ValueError(f"cannot read key file {path}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{path} is not a key file: {exc}") from exc
    text = public.decode("ascii", "replace"), None if secret is None else secret.decode()
    _check_key(text[0], f"public key in {path}")
    return text


# ---------------------------------------------------------------------- sockets


def apply_server(socket: Socket, curve: CurveServer | None) -> None:
    """Make ``socket`` a CURVE server (before it binds); nothing when ``curve`` is None."""
    if curve is None:
        return
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key.encode())
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def apply_client(socket: Socket, curve: CurveClient | None) -> None:
    """Make ``socket`` a CURVE client (before it connects); nothing when ``curve`` is None."""
    if curve is None:
        return
    socket.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key.encode())
    socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key.encode())
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key.encode())


class _AllowList:
    """The ZAP credentials provider: called on the authenticator's thread, reads only."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key.decode("ascii", "replace") in self._keys


def start_authenticator(context: Context, curve: CurveServer | None) -> ThreadAuthenticator | None:
    """A started ZAP handler enforcing ``curve.allowed_clients`` on ``context``, or None.

    Start it before any CURVE socket binds and ``stop()`` it before ``context.term()``.
    Configured once here, before its first request, so its thread only ever reads it.
    """
    if curve is None or curve.allowed_clients is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context, log=logging.getLogger("kvevents.publish.publisher.auth"))
    auth.configure_curve_callback(
        ZAP_DOMAIN, credentials_provider=_AllowList(curve.allowed_clients)
    )
    auth.start()
    return auth


# ---------------------------------------------------------------------- rejected handshakes

_WATCHED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
)


def monitor(socket: Socket, endpoint: str) -> None:
    """Report ``socket``'s failed handshakes on the inproc ``endpoint`` (a :class:`HandshakeWatch`)."""
    socket.monitor(endpoint, _WATCHED)


class HandshakeWatch:
    """Counts refused CURVE handshakes from monitor sockets; used only by its owning thread.

    ``auth_rejected``: clients refused by the allow-list. ``handshake_failed``: peers that
    failed the handshake itself (no CURVE keys, the wrong server key, garbage).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.auth_rejected = 0
        self.handshake_failed = 0
        self.sockets: list[Socket] = []
        self._roles: dict[Socket, str] = {}
        self._warn = RateLimitedWarning(logger)

    def attach(self, context: Context, endpoint: str, role: str) -> Socket:
        """A PAIR reading the monitor at ``endpoint`` (inproc: it may be bound later)."""
        sock: Socket = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self.sockets.append(sock)
        self._roles[sock] = role
        return sock

    def handle(self, sock: Socket) -> None:
        """Count every event waiting on ``sock``."""
        while True:
            try:
                event = parse_monitor_message(sock.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            self._count(event, self._roles.get(sock, "?"))

    def _count(self, event: int, role: str) -> None:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.auth_rejected += 1
            self._warn(
                "auth",
                "publisher rank %d (%s): refused a client key not on the allow-list",
                self.rank,
                role,
            )
        elif event & _WATCHED:
            self.handshake_failed += 1
            self._warn(
                "handshake",
                "publisher rank %d (%s): a peer failed the CURVE handshake "
                "(no keys or the wrong server key)",
                self.rank,
                role,
            )

    def close(self) -> None:
        """Close the monitor readers (the owning thread, at its end)."""
        for sock in self.sockets:
            sock.close(0)
        self.sockets.clear()
        self._roles.clear()
