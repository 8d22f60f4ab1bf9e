"""``kvevents route``: the OpenAI-compatible front door (``kvevents.route``) in front of engines."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvevents.cli.common import (
    UsageError,
    non_negative_int,
    positive_float,
    positive_int,
    stop_on_sigterm,
)
from kvevents.cli.config import (
    CONFIG_ENV,
    RouteSettings,
    apply_settings,
    default,
    engine_names,
    track_given,
)

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers
    from kvevents.route import Engine, EngineSpec, FrontDoor, ModelTokenizer
    from kvevents.scaleout import Replica
    from kvevents.service import IndexService

EXAMPLES = """examples:
  kvevents route --port 8000 --tokenizer /models/tiny --block-size 32 \\
      --engine a=http://10.0.0.5:8000 --kv-events a=tcp://10.0.0.5:5557 --kv-replay a=tcp://10.0.0.5:5600 \\
      --engine b=http://10.0.0.6:8000 --kv-events b=tcp://10.0.0.6:5557 --kv-replay b=tcp://10.0.0.6:5600
      the OpenAI API on :8000; each request goes where its prompt's prefix is cached
  kvevents route --tokenizer Qwen/Qwen3-0.6B --engine http://h:8000 --dp-size http://h:8000=2 \\
      --kv-events http://h:8000=tcp://h:5557
      a model id from the local Hugging Face cache; two data parallel ranks (events on
      5557 and 5558), each routed to on its own
  kvevents route --nats nats://127.0.0.1:4222 --tokenizer DIR --engine a=http://... \\
      the index from the JetStream stream of `kvevents relay` (engines named as there)

Each engine must run with --enable-prefix-caching, the same --block-size, --kv-events-config
(with a replay endpoint) and --enable-prompt-tokens-details (docs/route.md). Responses carry
x-kvevents-engine and x-kvevents-predicted-cached-tokens. GET / is a status page; /health,
/metrics. A line "serving on URL" goes to stdout once it accepts connections.
"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "route",
        help="run the OpenAI-compatible front door in front of engines",
        description="Take OpenAI requests, tokenize them exactly as the engines do, and send "
        "each where its prompt's prefix is cached (the KV events' index), weighed against the "
        "load the front door keeps itself. Precedence: flags > $KVEVENTS_ROUTE_<KEY> > the "
        "[route] table of --config > the defaults (docs/route.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    track_given(p)
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file, [route] table (default: ${CONFIG_ENV})",
    )
    p.add_argument("--host", default=_d("host"), help="address to listen on")
    p.add_argument("--port", type=non_negative_int, default=_d("port"), help="port (0: any free)")
    _add_engine_options(p)
    _add_token_options(p)
    _add_routing_options(p)
    _add_limit_options(p)
    _add_nats_options(p)
    p.set_defaults(run=run)


def _d(key: str) -> Any:  # a field's default: any of the model's field types
    return default(RouteSettings, key)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines")
    g.add_argument(
        "--engine",
        dest="engines",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an engine's OpenAI server (repeatable); NAME: its id (default: the URL)",
    )
    g.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="ENGINE=tcp://HOST:PORT",
        help="the engine's KV event stream (its base endpoint: rank r on PORT + r); without "
        "one the engine is routed on load alone",
    )
    g.add_argument(
        "--kv-replay",
        action="append",
        default=[],
        metavar="ENGINE=tcp://HOST:PORT",
        help="the engine's replay endpoint (base, like --kv-events)",
    )
    g.add_argument(
        "--dp-size",
        action="append",
        default=[],
        metavar="ENGINE=N",
        help="the engine's data parallel ranks, each routed to on its own",
    )
    g.add_argument("--topic", default=_d("topic"), help="the engines' KV event topic")
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=_d("block_size"),
        help="the engines' block size (vLLM's --block-size)",
    )
    g.add_argument(
        "--engine-block-size",
        action="append",
        default=[],
        metavar="ENGINE=N",
        help="an engine's block size where it is not --block-size",
    )
    g.add_argument(
        "--engine-cache-blocks",
        action="append",
        default=[],
        metavar="ENGINE=N",
        help="the blocks an engine's KV cache holds (per rank), where its /metrics does not "
        "say (vLLM's does); the default policy keeps requests within it",
    )
    g.add_argument(
        "--health-interval",
        type=positive_float,
        default=_d("health_interval"),
        help="seconds between each engine's health checks",
    )
    g.add_argument(
        "--health-timeout",
        type=positive_float,
        default=_d("health_timeout"),
        help="seconds a health check may take",
    )


def _add_token_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokens (as the engine makes them; docs/route.md)")
    g.add_argument(
        "--tokenizer",
        dest="tokenizers",
        action="append",
        default=[],
        metavar="[MODEL=]SOURCE",
        help="a served model's tokenizer and chat template: a directory, or a model id in the "
        "local Hugging Face cache (never downloaded); repeatable, one per model",
    )
    g.add_argument(
        "--chat-template",
        metavar="TEXT_OR_FILE",
        help="the engines' --chat-template, if they run one",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        help="the engines' --max-model-len (for truncate_prompt_tokens=-1)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="the engines run with --trust-request-chat-template",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="the engines run with --enable-auto-tool-choice",
    )
    g.add_argument("--tool-call-parser", metavar="NAME", help="the engines' --tool-call-parser")


def _add_routing_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument(
        "--policy", default=_d("policy"), help=f"routing policy (default: {_d('policy')})"
    )
    g.add_argument(
        "--stale-after",
        type=positive_float,
        default=_d("stale_after"),
        help="seconds after an answered request that stored a block by which the engine's "
        "events must arrive (else its stream gets no cache credit until they do)",
    )
    g.add_argument(
        "--prediction-grace",
        type=float,
        default=_d("prediction_grace"),
        help="seconds a request's predicted blocks outlive it",
    )
    g.add_argument(
        "--recent-window",
        type=positive_float,
        default=_d("recent_window"),
        help="seconds a request's blocks count in its engine's footprint (where a prefix "
        "no engine holds goes: the engine asked to keep the least)",
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits")
    for flag, kind, what in (
        ("--max-body-bytes", positive_int, "largest request body (413 above)"),
        ("--header-timeout", positive_float, "seconds a client has to send its headers"),
        ("--body-timeout", positive_float, "seconds a client has to send its body (408)"),
        ("--max-connections", positive_int, "open client connections; more are closed"),
        ("--connect-timeout", positive_float, "seconds to connect to an engine"),
        ("--first-byte-timeout", positive_float, "seconds an engine has to start answering"),
        ("--idle-timeout", positive_float, "seconds an answer may stay silent once begun"),
    ):
        key = flag[2:].replace("-", "_")
        g.add_argument(flag, type=kind, default=_d(key), help=what)
    g.add_argument(
        "--no-continue-streams",
        dest="continue_streams",
        action="store_false",
        default=_d("continue_streams"),
        help="cut a stream off when its engine is lost mid-answer (default: continue it on "
        "another engine)",
    )


def _add_nats_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the index from JetStream (docs/scale-out.md)")
    g.add_argument(
        "--nats", metavar="URL", help="take the index from the relay's stream on this NATS server"
    )
    g.add_argument(
        "--replica-name",
        default=_d("replica_name"),
        metavar="NAME",
        help="this front door's durable consumer (unique per instance)",
    )
    g.add_argument("--nats-stream", default=_d("nats_stream"), metavar="NAME")
    g.add_argument("--nats-prefix", default=_d("nats_prefix"), metavar="TOKEN")
    g.add_argument("--nats-bucket", default=_d("nats_bucket"), metavar="NAME")


# ----------------------------------------------------------------------------- building


def engine_specs(settings: RouteSettings) -> list[EngineSpec]:
    """The engines of the settings, each with its stream, replay and ranks."""
    from kvevents.route import EngineSpec

    if not settings.engines:
        raise UsageError("no engine: give at least one --engine URL")
    names = engine_names(settings.engines)
    events = _by_engine(settings.kv_events, names)
    replays = _by_engine(settings.kv_replay, names)
    ranks = {
        n: _count(v, "--dp-size", 1024) for n, v in _by_engine(settings.dp_size, names).items()
    }
    sizes = {
        n: _count(v, "--engine-block-size", 1 << 20)
        for n, v in _by_engine(settings.engine_block_size, names).items()
    }
    caches = {
        n: _count(v, "--engine-cache-blocks", 1 << 40)
        for n, v in _by_engine(settings.engine_cache_blocks, names).items()
    }
    specs = []
    for entry in settings.engines:
        name, url = names[entry.partition("=")[0] if "=" in entry else entry.rstrip("/")]
        specs.append(
            EngineSpec(
                url,
                name if name != url.rstrip("/") else None,
                events.get(name),
                replays.get(name),
                ranks.get(name, 1),
                sizes.get(name),
                topic=settings.topic,
                cache_blocks=caches.get(name),
            )
        )
    return specs


def _by_engine(entries: list[str], names: dict[str, tuple[str, str]]) -> dict[str, str]:
    out = {}
    for entry in entries:
        engine, _, value = entry.rpartition("=")
        out[names[engine][0]] = value
    return out


def _count(text: str, flag: str, most: int) -> int:
    try:
        count = int(text)
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a number") from None
    if not 1 <= count <= most:
        raise UsageError(f"{flag}: {count}: expected 1..{most}")
    return count


def tokenizers(settings: RouteSettings) -> dict[str | None, ModelTokenizer]:
    """The models' tokenizers, loaded (a missing one is a one-line error naming it)."""
    from kvevents.errors import TokenizerNotFound
    from kvevents.route import EngineOptions, ModelTokenizer

    if not settings.tokenizers:
        raise UsageError("no tokenizer: give --tokenizer DIR (or MODEL=DIR per served model)")
    options = EngineOptions(
        chat_template=settings.chat_template,
        trust_request_chat_template=settings.trust_request_chat_template,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        tool_call_parser=settings.tool_call_parser,
        max_model_len=settings.max_model_len,
    )
    out: dict[str | None, ModelTokenizer] = {}
    for entry in settings.tokenizers:
        model, sep, source = entry.partition("=")
        key, source = (model, source) if sep else (None, entry)
        try:
            out[key] = ModelTokenizer.load(source, model_name=key or source, options=options)
        except (TokenizerNotFound, OSError, ValueError) as exc:
            raise UsageError(f"--tokenizer {entry}: {exc}") from None
    return out


def front_door(settings: RouteSettings, service: IndexService | None = None) -> FrontDoor:
    from kvevents.http import HttpLimits
    from kvevents.route import FrontDoor, PlannerOptions, ProxyOptions

    limits = HttpLimits(
        settings.max_body_bytes,
        settings.header_timeout,
        settings.body_timeout,
        settings.max_connections,
    )
    proxy = ProxyOptions(
        limits=limits,
        connect_timeout=settings.connect_timeout,
        first_byte_timeout=settings.first_byte_timeout,
        idle_timeout=settings.idle_timeout,
        continue_streams=settings.continue_streams,
    )
    planner = PlannerOptions(
        policy=settings.policy,
        block_size=settings.block_size,
        stale_after=settings.stale_after,
        grace=settings.prediction_grace,
        recent_window=settings.recent_window,
    )
    return FrontDoor(
        engine_specs(settings),
        tokenizers(settings),
        settings.host,
        settings.port,
        planner_options=planner,
        proxy_options=proxy,
        health_interval=settings.health_interval,
        health_timeout=settings.health_timeout,
        service=service,
    )


def _replica(settings: RouteSettings) -> Replica:
    """``--nats``: a replica (no snapshots of its own) whose service the front door uses."""
    from kvevents.index import LoadBook, PrefixIndex, Router
    from kvevents.scaleout import JetStreamOptions, Replica, ReplicaOptions

    options = ReplicaOptions(name=settings.replica_name, snapshot_batches=0, snapshot_interval=0)
    stream = JetStreamOptions(
        stream=settings.nats_stream, prefix=settings.nats_prefix, bucket=settings.nats_bucket
    )
    replica = Replica(settings.nats or "", jetstream=stream, options=options)
    index = PrefixIndex()
    router = Router(index, settings.policy, loads=LoadBook())
    replica.service = replica.new_service(index=index, router=router)
    return replica


def _engine_line(engine: Engine) -> str:
    """One engine at start: its id, state, models and cache (the cache bound's source)."""
    state = engine.state.value if engine.up else f"{engine.state.value} ({engine.reason})"
    models = ", ".join(sorted(engine.models)) or "no model listed"
    if engine.cache_blocks is None:
        cache = "cache size unknown (no cache bound)"
    else:
        source = "given" if engine.cache_given else "from its /metrics"
        cache = f"cache {engine.cache_blocks} blocks ({source})"
    return f"engine {engine.id}: {state}; {models}; {cache}"


def run(args: argparse.Namespace) -> int:
    from kvevents.cli.relay import start_replica

    args = apply_settings(RouteSettings, "route", args)
    settings: RouteSettings = args.settings
    replica = _replica(settings) if settings.nats else None
    door = front_door(settings, None if replica is None else replica.service)
    with stop_on_sigterm():
        if replica is not None:
            start_replica(replica)
        try:
            door.start(register=replica is None)
        except OSError as exc:
            raise UsageError(str(exc)) from None
        try:
            print(f"serving on {door.url}", flush=True)
            for engine in door.pool.engines:
                print(f"  {_engine_line(engine)}", flush=True)
            assert door.server is not None
            door.server.wait()
        finally:
            door.close()
            if replica is not None:
                replica.close()
    counts = door.planner.stats().counts
    print(
        f"stopped: {counts.planned} requests planned, predictions exact on {counts.exact} of "
        f"{counts.compared}",
        file=sys.stderr,
    )
    return 0
