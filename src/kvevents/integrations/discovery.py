"""Engine discovery: the KV event endpoints an engine advertises over HTTP.

SGLang describes its publisher in ``GET /server_info`` under ``kv_events`` (absent or null when
it publishes nothing)::

    {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
     "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5600}

Rank r publishes on ``endpoint_port_base + r`` (and replays on ``replay_endpoint_port_base + r``,
a key present only when replay is configured) for each of the ``dp_size`` ranks. A wildcard
``endpoint_host`` (``*``, ``0.0.0.0``, ``::``) is the engine's bind address, not one to dial:
the host of the URL asked is used instead. ``publisher`` is the name in the engine's config:
SGLang's ``"zmq"``, or ``"kvevents"`` when it publishes through kvevents' plugin
(``kvevents.integrations.sglang``), the same wire. :func:`discover` reads it with the standard
library and returns what ``worker_streams`` or a ``WorkerRegistration`` need;
:func:`engine_option` reads the ``[ID=]URL`` of the CLI's ``--engine``.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvevents._types import Document, DocumentView, JSONValue
from kvevents.bounds import MAX_BLOCK_SIZE, MAX_ENDPOINT_LENGTH, MAX_NAME_LENGTH, MAX_RANKS
from kvevents.deadline import Deadline
from kvevents.errors import DiscoveryError, LayoutError
from kvevents.integrations._fetch import FetchError, fetch
from kvevents.subscribe import StreamSpec, worker_streams
from kvevents.wire import MAX_PORT, parse_endpoint

if TYPE_CHECKING:
    from kvevents.security import CurveClient

__all__ = [
    "MAX_ANSWER_BYTES",
    "EngineEndpoints",
    "discover",
    "engine_option",
    "parse_server_info",
]

#: Paths tried in order: SGLang's current one, then the name older releases answer.
INFO_PATHS = ("/server_info", "/get_server_info")
_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
#: Publisher names whose streams are kvevents' wire: SGLang's own, and kvevents' plugin.
PUBLISHERS = ("zmq", "kvevents")
#: The largest answer read: a server_info is a few KB; more is not a server_info.
MAX_ANSWER_BYTES = 4 * 2**20
_ACCEPT = {"accept": "application/json"}
# The longest endpoint host: an endpoint (``tcp://HOST:PORT``) is bounded as over HTTP.
_MAX_HOST = MAX_ENDPOINT_LENGTH - len("tcp://:65535")


@dataclasses.dataclass(frozen=True)
class EngineEndpoints:
    """One engine's KV event streams, as it advertises them.

    ``endpoint`` and ``replay_endpoint`` are base endpoints (rank r: port + r); ``ranks`` is the
    engine's data parallel size, ``block_size`` the size its stores use, ``url`` where it was read.
    """

    url: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    ranks: int

    def streams(self, worker_id: str, *, curve: CurveClient | None = None) -> list[StreamSpec]:
        """Every rank's stream, named ``worker_id``, for a ``Subscriber``."""
        return worker_streams(
            worker_id,
            self.endpoint,
            self.replay_endpoint,
            ranks=self.ranks,
            topic=self.topic,
            curve=curve,
        )

    def registration_fields(self, worker_id: str) -> Document:
        """The fields of a ``kvevents.service.WorkerRegistration`` for this engine
        (``WorkerRegistration(**engine.registration_fields("a"))``; the service layer sits
        above this one, so it is not built here)."""
        return {
            "worker_id": worker_id,
            "endpoint": self.endpoint,
            "block_size": self.block_size,
            "ranks": tuple(range(self.ranks)),
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }


def discover(url: str, *, timeout: float = 5.0) -> EngineEndpoints:
    """The KV event endpoints of the engine serving at ``url`` (``http://HOST:PORT``).

    Reads ``/server_info`` (``/get_server_info`` when that is a 404); a URL whose path already
    names the page is read as given. ``timeout`` is the whole discovery's: both pages, each
    with its connect, headers, redirects and body (at most :data:`MAX_ANSWER_BYTES`). Raises
    :class:`DiscoveryError` naming the URL and, for a missing or invalid field, the key.
    """
    deadline = Deadline(timeout)
    for target in _targets(url):
        try:
            info = _fetch(target, deadline, timeout)
        except _NotFound:
            continue
        return parse_server_info(info, target)
    raise DiscoveryError(url, f"no server info page ({', '.join(INFO_PATHS)} answer 404)")


def engine_option(text: str) -> tuple[str, str]:
    """``(worker id, URL)`` from ``[ID=]URL``; the ID defaults to the URL's ``host:port``."""
    worker, sep, url = text.partition("=")
    if not sep or "://" in worker:
        worker, url = "", text
    return worker or urllib.parse.urlsplit(url).netloc or url, url


class _NotFound(Exception):
    """The page is not there (HTTP 404): try the next name."""


def _targets(url: str) -> list[str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DiscoveryError(url, "expected an http:// or https:// URL with a host")
    if parts.path.rstrip("/").endswith(INFO_PATHS):
        return [url]
    base = url.rstrip("/")
    return [base + path for path in INFO_PATHS]


def _fetch(url: str, deadline: Deadline, timeout: float) -> JSONValue:
    try:
        body = fetch(url, timeout=deadline.remaining(), max_bytes=MAX_ANSWER_BYTES, headers=_ACCEPT)
    except FetchError as exc:
        if exc.status == 404:
            raise _NotFound from None
        if deadline.expired:  # the whole discovery's time, not this page's share of it
            raise DiscoveryError(url, f"no answer within {timeout:g}s") from None
        raise DiscoveryError(url, exc.reason) from None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise DiscoveryError(url, f"the answer is not JSON ({exc})") from None
    except RecursionError:
        raise DiscoveryError(url, "the answer is not JSON: nested too deeply") from None


def parse_server_info(info: JSONValue, url: str) -> EngineEndpoints:
    """The endpoints in a ``/server_info`` answer read from ``url`` (whose host replaces a
    wildcard ``endpoint_host``)."""
    if not isinstance(info, Mapping):
        raise DiscoveryError(url, f"the answer is a JSON {type(info).__name__}, not an object")
    kv = info.get("kv_events")
    if kv is None:
        raise DiscoveryError(
            url,
            "kv_events is missing: the engine publishes no KV events "
            "(start it with --kv-events-config)",
            key="kv_events",
        )
    if not isinstance(kv, Mapping):
        raise DiscoveryError(url, "kv_events is not an object", key="kv_events")
    publisher = kv.get("publisher", "zmq")
    if publisher not in PUBLISHERS:
        raise DiscoveryError(
            url,
            f"kv_events.publisher is {_shown(publisher)}, not one of "
            f"{', '.join(map(repr, PUBLISHERS))}",
            key="kv_events.publisher",
        )
    host = _host(kv, "endpoint_host", url)
    replay_host = _host(kv, "replay_endpoint_host", url) if "replay_endpoint_host" in kv else host
    ranks = _count(kv, "dp_size", url, MAX_RANKS)
    port = _base_port(kv, "endpoint_port_base", url, ranks)
    replay_port = _base_port(kv, "replay_endpoint_port_base", url, ranks, required=False)
    return EngineEndpoints(
        url=url,
        endpoint=f"tcp://{host}:{port}",
        replay_endpoint=None if replay_port is None else f"tcp://{replay_host}:{replay_port}",
        topic=_topic(kv, url),
        block_size=_count(kv, "block_size", url, MAX_BLOCK_SIZE),
        ranks=ranks,
    )


def _shown(value: object) -> str:
    """``value`` as an error shows it: its repr, cut short (an answer may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _required(kv: DocumentView, key: str, url: str) -> JSONValue:
    if key not in kv:
        raise DiscoveryError(url, f"kv_events.{key} is missing", key=f"kv_events.{key}")
    return kv[key]


def _host(kv: DocumentView, key: str, url: str) -> str:
    host = _required(kv, key, url)
    if not isinstance(host, str):
        raise DiscoveryError(url, f"kv_events.{key} is not a string", key=f"kv_events.{key}")
    if len(host) > _MAX_HOST:
        raise DiscoveryError(
            url, f"kv_events.{key} is over {_MAX_HOST} characters", key=f"kv_events.{key}"
        )
    if host.strip() in _WILDCARDS:
        # A bind address: dial the host the engine was reached at.
        host = urllib.parse.urlsplit(url).hostname or ""
    host = host.strip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address in an endpoint needs its brackets
    try:
        parse_endpoint(f"tcp://{host}:1")
    except LayoutError as exc:
        raise DiscoveryError(
            url, f"kv_events.{key} = {_shown(host)} is not a host ({exc})", key=f"kv_events.{key}"
        ) from None
    return host


def _base_port(
    kv: DocumentView, key: str, url: str, ranks: int, *, required: bool = True
) -> int | None:
    """The base port at ``key``; rank r publishes on it + r, so every rank's must be a port."""
    if not required and kv.get(key) is None:
        return None
    port = _required(kv, key, url)
    if type(port) is not int or not 1 <= port <= MAX_PORT:
        raise DiscoveryError(
            url,
            f"kv_events.{key} = {_shown(port)} is not a port in 1..{MAX_PORT}",
            key=f"kv_events.{key}",
        )
    if port + ranks - 1 > MAX_PORT:
        raise DiscoveryError(
            url,
            f"kv_events.{key} = {port} + {ranks - 1} (kv_events.dp_size - 1) exceeds {MAX_PORT}",
            key=f"kv_events.{key}",
        )
    return port


def _count(kv: DocumentView, key: str, url: str, top: int) -> int:
    """The integer at ``key``, in 1..``top`` (the bound a registration over HTTP has)."""
    value = _required(kv, key, url)
    if type(value) is not int or not 1 <= value <= top:
        raise DiscoveryError(
            url,
            f"kv_events.{key} = {_shown(value)} is not an integer >= 1 and <= {top}",
            key=f"kv_events.{key}",
        )
    return value


def _topic(kv: DocumentView, url: str) -> str:
    topic = kv.get("topic", "")
    if not isinstance(topic, str):
        raise DiscoveryError(url, "kv_events.topic is not a string", key="kv_events.topic")
    if len(topic) > MAX_NAME_LENGTH:
        raise DiscoveryError(
            url, f"kv_events.topic is over {MAX_NAME_LENGTH} characters", key="kv_events.topic"
        )
    return topic
