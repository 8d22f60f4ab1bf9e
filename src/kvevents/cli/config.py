"""Settings of ``kvevents serve`` and ``kvevents publish`` from a file, the environment and flags.

Sources, each overriding the one before it, key by key:

1. the defaults of the command's model (:class:`ServeSettings`, :class:`PublishSettings`);
2. a TOML file, ``--config FILE`` or ``$KVEVENTS_CONFIG``: a ``[serve]`` and/or a
   ``[publish]`` table, keys named like the flags with ``_`` for ``-`` (``block_size``);
   relative paths in it are relative to the file;
3. environment variables ``KVEVENTS_SERVE_<KEY>`` / ``KVEVENTS_PUBLISH_<KEY>`` (``KEY`` the
   key in capitals; a list is comma-separated);
4. the flags given on the command line.

A list replaces the list of an earlier source; it is not appended to. Every source is
validated on its own against the model (strict: a string is not a number in a file; extra
keys forbidden), so an error names the source and the key: ``serve.toml: [serve] port: Input
should be less than or equal to 65535``, ``$KVEVENTS_SERVE_PORT: ...``, ``--port: ...``.

The model's fields are the parser's destinations (a test holds them together); a flag's
default in ``--help`` is the model's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvevents._types import Document
from kvevents.bounds import MAX_BLOCK_SIZE, MAX_NAME_LENGTH, MAX_RANK, MAX_RANKS
from kvevents.cli.common import UsageError
from kvevents.files import read_bounded

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the conditional dependency of Python 3.10
    import tomli as tomllib

__all__ = [
    "CONFIG_ENV",
    "PolicyName",
    "PublishSettings",
    "RouteSettings",
    "ServeSettings",
    "Settings",
    "WorkerEntry",
    "apply_settings",
    "engine_names",
    "env_prefix",
    "resolve",
    "track_given",
]

#: The environment variable naming the config file when ``--config`` is not given.
CONFIG_ENV = "KVEVENTS_CONFIG"
#: The largest settings file read (a few KB is a big one).
MAX_CONFIG_BYTES = 1 << 20
#: Where :func:`track_given` records the flags given on the command line (dest: option).
GIVEN = "given_flags"

#: The router's policies (``kvevents.index.POLICIES``, held equal by a test: the
#: parser must build without the index, which needs the service extra).
PolicyName = Literal["longest_prefix", "prefix_load", "bounded_prefix", "round_robin", "random"]

Port = Annotated[int, Field(ge=0, le=65535)]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]
BlockSize = Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)]
RankCount = Annotated[int, Field(ge=1, le=MAX_RANKS)]
RankList = Annotated[list[Annotated[int, Field(ge=0, le=MAX_RANK)]], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class Settings(BaseModel):
    """A command's settings: strict types, no unknown keys, read-only once made."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    #: Keys holding file paths: relative ones in a config file are relative to the file.
    paths: ClassVar[frozenset[str]] = frozenset()


class WorkerEntry(Settings):
    """A worker ``kvevents serve`` indexes from the start (base endpoints: rank r on port + r)."""

    id: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=r"^[^:=,]+$")]
    endpoint: Text
    replay_endpoint: Text | None = None
    ranks: RankCount | RankList | None = None  #: a count or rank numbers; default: ``ranks``
    block_size: BlockSize | None = None  #: default: the service's ``block_size``

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        from kvevents.wire import parse_endpoint

        if value is not None:
            parse_endpoint(value)  # LayoutError, a ValueError: reported with the key
        return value

    def rank_numbers(self, default: int) -> tuple[int, ...]:
        """The ranks to index: this entry's, else ``default`` of them from 0."""
        ranks = self.ranks if self.ranks is not None else default
        return tuple(range(ranks)) if isinstance(ranks, int) else tuple(sorted(set(ranks)))


def _worker_from_flag(text: str) -> Document:
    """``ID=ENDPOINT[,REPLAY]`` (``--worker``) as a :class:`WorkerEntry`'s keys."""
    worker, sep, endpoints = text.partition("=")
    parts = endpoints.split(",")
    if not sep or not worker or len(parts) > 2 or not all(parts):
        raise ValueError(f"{text!r}: expected ID=ENDPOINT[,REPLAY_ENDPOINT]")
    if ":" in worker:
        raise ValueError(f"{text!r}: serve registers base endpoints, not one rank")
    replay = parts[1] if len(parts) == 2 else None
    return {"id": worker, "endpoint": parts[0], "replay_endpoint": replay}


class ServeSettings(Settings):
    """``kvevents serve``: listening, the router's knobs, workers, access and client limits."""

    paths: ClassVar[frozenset[str]] = frozenset(
        {"state_file", "auth_token_file", "curve_server_key", "curve_secret"}
    )

    host: Text = "127.0.0.1"
    port: Port = 8090
    api: Literal["kvevents", "dynamo"] = "kvevents"
    policy: PolicyName = "longest_prefix"
    seed: Annotated[int, Field(ge=0)] = 0
    prefill_weight: Weight = 1.0
    load_weight: Weight = 1.0
    load_ttl: Seconds = 10.0
    workers: list[WorkerEntry] = []
    ranks: RankCount = 1
    block_size: BlockSize = 16
    engines: list[Text] = []  #: ``[ID=]URL``: engines registered from their /server_info
    discovery_timeout: Seconds = 5.0
    state_file: Text | None = None
    auth_token_file: Text | None = None
    auth_reads: bool = False
    #: Serve without a token on a host other than loopback (refused otherwise).
    allow_unauthenticated: bool = False
    allow_endpoint_host: list[Text] = []
    max_body_bytes: Positive = 8 << 20
    header_timeout: Seconds = 10.0
    body_timeout: Seconds = 30.0
    max_connections: Positive = 256
    send_timeout: Seconds = 30.0
    curve_server_key: Text | None = None
    curve_secret: Text | None = None
    # A router replica fed from NATS JetStream (docs/scale-out.md); None: from ZeroMQ.
    nats: Text | None = None
    replica_name: Text = "replica"
    snapshot_batches: Annotated[int, Field(ge=0)] = 100_000
    snapshot_interval: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 60.0
    inactive_threshold: Seconds = 30.0
    nats_stream: Text = "KVEVENTS"
    nats_prefix: Text = "kvevents"
    nats_bucket: Text = "kvevents-snapshots"

    @field_validator("workers", mode="before")
    @classmethod
    def _flag_workers(cls, value: Any) -> Any:  # pydantic passes the raw input before validation
        if isinstance(value, list):
            return [_worker_from_flag(v) if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _distinct_workers(self) -> ServeSettings:
        seen: set[str] = set()
        for entry in self.workers:
            if entry.id in seen:
                raise ValueError(f"workers: worker id {entry.id!r} is given twice")
            seen.add(entry.id)
        return self


class RouteSettings(Settings):
    """``kvevents route``: listening, the engines and their streams, tokenizers, routing."""

    paths: ClassVar[frozenset[str]] = frozenset()

    host: Text = "127.0.0.1"
    port: Port = 8000
    #: ``[NAME=]URL``: an engine's OpenAI server (NAME: its id; default: the URL).
    engines: list[Text] = []
    #: ``ENGINE=tcp://HOST:PORT``: an engine's KV event stream (its base endpoint: rank r on
    #: port + r); ENGINE is its NAME or URL. An engine without one is routed on load alone.
    kv_events: list[Text] = []
    #: ``ENGINE=tcp://HOST:PORT``: the engine's replay endpoint (base, as ``kv_events``).
    kv_replay: list[Text] = []
    #: ``ENGINE=N``: the engine's data parallel ranks (each routed to on its own).
    dp_size: list[Text] = []
    #: ``ENGINE=N``: an engine's block size where it is not ``block_size`` (engines serving
    #: other models may page their caches otherwise).
    engine_block_size: list[Text] = []
    #: ``ENGINE=N``: the blocks an engine's KV cache holds per rank, where its ``/metrics``
    #: does not say (vLLM's says: ``num_gpu_blocks``).
    engine_cache_blocks: list[Text] = []
    topic: str = ""
    #: ``[MODEL=]SOURCE``: a served model's tokenizer and chat template, a directory or a
    #: model id in the local Hugging Face cache (without MODEL: every model without its own).
    tokenizers: list[Text] = []
    block_size: BlockSize = 16
    policy: PolicyName = "bounded_prefix"
    health_interval: Seconds = 2.0
    health_timeout: Seconds = 1.0
    connect_timeout: Seconds = 2.0
    first_byte_timeout: Seconds = 600.0
    idle_timeout: Seconds = 300.0
    #: A stream whose engine is lost mid-answer goes on on another engine (docs/route.md).
    continue_streams: bool = True
    stale_after: Seconds = 5.0
    prediction_grace: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    #: Seconds a request's blocks count in its engine's footprint (docs/route.md).
    recent_window: Seconds = 60.0
    max_body_bytes: Positive = 8 << 20
    header_timeout: Seconds = 10.0
    body_timeout: Seconds = 30.0
    max_connections: Positive = 256
    #: The engines' own flags that change prompts' tokens (see docs/route.md).
    chat_template: Text | None = None
    max_model_len: Positive | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: Text | None = None
    # The index from the JetStream replicas' stream (docs/scale-out.md); None: from the engines.
    nats: Text | None = None
    replica_name: Text = "route"
    nats_stream: Text = "KVEVENTS"
    nats_prefix: Text = "kvevents"
    nats_bucket: Text = "kvevents-snapshots"

    @model_validator(mode="after")
    def _named_engines(self) -> RouteSettings:
        names = engine_names(self.engines)
        for key in (
            "kv_events",
            "kv_replay",
            "dp_size",
            "engine_block_size",
            "engine_cache_blocks",
        ):
            for entry in getattr(self, key):
                engine, sep, value = entry.rpartition("=")
                if not sep or not engine or not value:
                    raise ValueError(f"{key}: {entry!r}: expected ENGINE=VALUE")
                if engine not in names:
                    raise ValueError(f"{key}: {entry!r}: no --engine {engine!r} (NAME or URL)")
        return self


def engine_names(entries: list[str]) -> dict[str, tuple[str, str]]:
    """``[NAME=]URL`` entries by the name and by the URL they may be named with: (name, url)."""
    out: dict[str, tuple[str, str]] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep:
            name, url = entry.rstrip("/"), entry
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engines: {entry!r}: expected [NAME=]http://HOST:PORT")
        if name in out:
            raise ValueError(f"engines: {name!r} is given twice")
        out[name] = out[url.rstrip("/")] = (name, url)
    return out


class PublishSettings(Settings):
    """``kvevents publish``: the simulated engine, its publishers and its workload."""

    paths: ClassVar[frozenset[str]] = frozenset({"trace", "curve_secret", "curve_allow"})

    endpoint: Text = "tcp://*:5557"
    replay_endpoint: Text = "tcp://*:5600"  #: ``none``: no replay
    ranks: RankCount = 1
    topic: str = ""
    rate: Seconds = 20.0
    trace: Text | None = None
    concurrency: Positive = 4
    block_size: BlockSize = 16
    heartbeat: Seconds = 1.0
    seed: Annotated[int, Field(ge=0)] = 0
    count: Positive | None = None
    duration: Seconds | None = None
    metrics_port: Port | None = None
    # ``json`` is a BaseModel method: the field takes the key by its alias.
    json_lines: bool = Field(False, alias="json")
    curve_secret: Text | None = None
    curve_allow: Text | None = None


S = TypeVar("S", bound=Settings)


def keys(model: type[Settings]) -> dict[str, str]:
    """The model's keys (as in files, flags' destinations and the environment) by field name."""
    return {name: f.alias or name for name, f in model.model_fields.items()}


# A field's default: any of the model's field types.
def default(model: type[Settings], key: str) -> Any:
    """The model's default for ``key``, for the parser's ``default=`` (shown in ``--help``)."""
    for name, alias in keys(model).items():
        if alias == key:
            return model.model_fields[name].get_default(call_default_factory=True)
    raise KeyError(key)


def env_prefix(command: str) -> str:
    """``KVEVENTS_SERVE_`` for ``serve``: the prefix of that command's variables."""
    return f"KVEVENTS_{command.upper()}_"


# ----------------------------------------------------------------------------- flags


def _tracked(base: type[argparse.Action]) -> type[argparse.Action]:
    # A subclass of an Action class known only at run time, which mypy cannot check.
    class Given(base):  # type: ignore[valid-type,misc]
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: object,  # what the flag's type made of its text
            option: str | None = None,
        ) -> None:
            super().__call__(parser, namespace, values, option)
            given = getattr(namespace, GIVEN, None)
            if given is None:
                given = {}
                setattr(namespace, GIVEN, given)
            given[self.dest] = option or self.dest

    return Given


def track_given(parser: argparse.ArgumentParser) -> None:
    """Make the options added to ``parser`` from now on record that they were given.

    A flag left out and a flag given its default value parse the same; precedence needs the
    difference (``--port 8090`` beats ``port = 9000`` in the file).
    """
    for name, action in (
        (None, argparse._StoreAction),
        ("store", argparse._StoreAction),
        ("store_true", argparse._StoreTrueAction),
        ("append", argparse._AppendAction),
    ):
        parser.register("action", name, _tracked(action))


# ----------------------------------------------------------------------------- sources


def _where_key(loc: tuple[int | str, ...], model: type[Settings], unknown: bool) -> str:
    """``workers[0].endpoint`` from pydantic's location; ``unknown``: its last part is a key
    the model does not have (shown: it is what is wrong)."""
    named = set(WorkerEntry.model_fields) | set(keys(model).values())
    parts: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part in named or (unknown and i == len(loc) - 1):
            parts.append(part if not parts else f".{part}")
        # other parts name the branch of a union (``int``, ``list[int]``): left out
    return "".join(parts) or "settings"


def _error(
    where: str,
    exc: ValidationError,
    model: type[Settings],
    name: Callable[[str], str] | None = None,
) -> str:
    first = exc.errors()[0]
    key = _where_key(tuple(first["loc"]), model, first["type"] == "extra_forbidden")
    label = name(key) if name is not None else f"{where}{key}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    message = message.removeprefix("Value error, ")
    return f"{label}: {message}{more}"


def _validated(
    model: type[S],
    data: Document,
    where: str,
    strict: bool = True,
    name: Callable[[str], str] | None = None,
) -> Document:
    """``data`` checked against ``model`` alone; its values as the model made them."""
    try:
        settings = model.model_validate(data, strict=strict)
    except ValidationError as exc:
        raise UsageError(_error(where, exc, model, name)) from None
    fields = {alias: name for name, alias in keys(model).items()}
    return {key: getattr(settings, fields[key]) for key in data}


def _read_toml(path: Path) -> Document:
    try:
        text = read_bounded(path, MAX_CONFIG_BYTES, "settings file").decode()
        document: Document = tomllib.loads(text)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise UsageError(f"{path}: not valid TOML: {why}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise UsageError(f"{path}: not valid TOML: nested too deeply") from None
    return document


def _file_layer(model: type[S], command: str, path: Path) -> Document:
    document = _read_toml(path)
    for key, value in document.items():
        if not isinstance(value, dict) or key not in ("serve", "publish", "route"):
            raise UsageError(f"{path}: {key!r}: expected a [serve], [publish] or [route] table")
    table = dict(document.get(command, {}))
    for key in model.paths & table.keys():
        if isinstance(table[key], str) and table[key]:
            table[key] = str(path.parent / Path(table[key]).expanduser())
    return _validated(model, table, f"{path}: [{command}] ")


def _env_layer(model: type[S], command: str, environ: Mapping[str, str]) -> Document:
    prefix = env_prefix(command)
    data: Document = {}
    for var, text in environ.items():
        if not var.startswith(prefix):
            continue
        key = var[len(prefix) :].lower()
        if key == "workers":
            raise UsageError(f"${var}: workers are set in the config file or with --worker")
        data[key] = _env_value(model, key, text)
    # Environment values are text: read as the model's types (lax), then held to its rules.
    return _validated(model, data, "", strict=False, name=lambda k: f"${prefix}{k.upper()}")


def _env_value(model: type[Settings], key: str, text: str) -> list[str] | str | None:
    field = model.model_fields.get(key)
    if field is not None and getattr(field.annotation, "__origin__", None) is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    if text == "" and field is not None and not field.is_required() and field.default is None:
        return None  # set but empty: unset, for the keys that may be unset
    return text


def _flag_layer(model: type[S], args: argparse.Namespace) -> Document:
    given: dict[str, str] = getattr(args, GIVEN, None) or {}
    known = set(keys(model).values())
    data = {dest: getattr(args, dest) for dest in given if dest in known}
    return _validated(model, data, "", name=lambda k: given.get(k.split("[")[0].split(".")[0], k))


def resolve(
    model: type[S], command: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> S:
    """The settings of ``command``: defaults, then the file, the environment, the flags."""
    env = os.environ if environ is None else environ
    config = getattr(args, "config", None) or env.get(CONFIG_ENV) or None
    merged: Document = {}
    if config is not None:
        merged.update(_file_layer(model, command, Path(config)))
    merged.update(_env_layer(model, command, env))
    merged.update(_flag_layer(model, args))
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise UsageError(_error("", exc, model)) from None


def apply_settings(
    model: type[Settings],
    command: str,
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """``args`` with every key replaced by its resolved setting (see :func:`resolve`)."""
    settings = resolve(model, command, args, environ)
    values = {alias: getattr(settings, name) for name, alias in keys(model).items()}
    return argparse.Namespace(**{**vars(args), **values, "settings": settings})
