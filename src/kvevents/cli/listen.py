"""``kvevents listen``: tail KV event streams, with gaps, replays and restarts called out."""

from __future__ import annotations

import argparse
import sys
import time
import urllib.parse
from typing import TYPE_CHECKING

from kvevents.cli.common import UsageError, plural, positive_float, positive_int, stop_on_sigterm
from kvevents.cli.output import JsonOutput, LiveOutput, Output, StatsSource, TextOutput
from kvevents.cli.render import ListenView, stats_record
from kvevents.cli.secure import add_client_options, client_curve
from kvevents.cli.specs import stream_specs
from kvevents.events import StreamKey
from kvevents.integrations.discovery import discover
from kvevents.subscribe import ReplayOptions, StreamSpec, SubscriberOptions

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers
    from kvevents.subscribe import Subscriber

EXAMPLES = """examples:
  kvevents listen tcp://10.0.0.5:5557
      one engine, rank 0, no replay (every gap is reported lost)
  kvevents listen tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5600 --ranks 4
      four ranks (ports 5557-5560, replay 5600-5603); gaps are replayed
  kvevents listen --worker a=tcp://h1:5557,tcp://h1:5600 --worker b=tcp://h2:5557 --json
      two named workers as JSON lines (one object per batch, plus call-outs)
  kvevents listen --worker sim:1=tcp://127.0.0.1:40123 --count 10 --full --json
      rank 1 of worker "sim" at its own endpoint; stop after 10 batches; full events
  kvevents listen --engine http://10.0.0.5:30000
      the streams an SGLang server advertises in /server_info (ranks, replay, topic)

output:
  a live table on a terminal; one line per batch otherwise (--plain forces it); --json
  gives objects with "type": batch | gap | replayed | unrecoverable | complete | restart |
  removed | summary. A line "listening to N streams" goes to stderr once subscribed.
"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "listen",
        help="tail one or more event streams",
        description="Subscribe to engines' KV event streams and show every batch, with gaps, "
        "replays, unrecoverable ranges and restarts called out, then a summary.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("endpoints", nargs="*", metavar="ENDPOINT", help="base PUB endpoint(s)")
    p.add_argument(
        "--replay",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="base replay endpoint, one per positional ENDPOINT, in order",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ID[:RANK]=EP[,REPLAY]",
        help="a named worker (with :RANK, that rank's own endpoints)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="[ID=]URL",
        help="an engine's HTTP URL: read its streams from /server_info",
    )
    p.add_argument(
        "--discovery-timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for an engine's /server_info (default 5)",
    )
    p.add_argument("--ranks", type=positive_int, default=1, help="ranks per worker (default 1)")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    p.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    p.add_argument("--full", action="store_true", help="include every event, not only counts")
    p.add_argument("--count", type=positive_int, help="stop after N batches")
    p.add_argument("--duration", type=positive_float, help="stop after S seconds")
    p.add_argument(
        "--replay-timeout",
        type=positive_float,
        default=5.0,
        help="seconds of replay silence before a retry (default 5)",
    )
    add_client_options(p)
    p.set_defaults(run=run)


def _output(args: argparse.Namespace, stats: StatsSource) -> Output:
    if args.json:
        return JsonOutput()
    if args.plain or not sys.stdout.isatty():
        return TextOutput()
    return LiveOutput(stats)


def _done(args: argparse.Namespace, view: ListenView, deadline: float | None) -> bool:
    if args.count is not None and view.batches >= args.count:
        return True
    return deadline is not None and time.monotonic() >= deadline


def run(args: argparse.Namespace) -> int:
    from kvevents.subscribe import Subscriber

    specs = _specs(args)
    options = SubscriberOptions(
        status_items=True,
        replay=ReplayOptions(idle_timeout=args.replay_timeout),
        curve=client_curve(args),
    )
    view = ListenView(full=args.full)
    began = time.monotonic()
    deadline = None if args.duration is None else began + args.duration
    status = 0
    with stop_on_sigterm(), Subscriber(specs, options=options) as sub:
        out = _output(args, sub.stream_stats)
        print(f"listening to {plural(len(specs), 'stream')}", file=sys.stderr, flush=True)
        try:
            while not _done(args, view, deadline):
                item = sub.get(timeout=0.25)
                if item is None:
                    out.refresh()
                    if _feed_dead(sub):
                        status = 1
                        break
                    continue
                for record in view.records(item):
                    out.emit(record)
        except KeyboardInterrupt:
            pass
        elapsed = time.monotonic() - began
        out.emit(stats_record(sub.stream_stats(), view.batches, elapsed))
        out.close()
    if status == 0 and not view.batches:
        print(
            nothing_received(specs, elapsed, curve=args.curve_server_key is not None),
            file=sys.stderr,
        )
        return 3
    return status


def nothing_received(specs: list[StreamSpec], seconds: float, *, curve: bool) -> str:
    """Why a run may have seen no batch at all: the likely causes, in the order to check."""
    endpoints = ", ".join(sorted({s.endpoint for s in specs})) or "no endpoint"
    causes = [
        "nothing publishes there (is the engine up, with kv events enabled?)",
        "the endpoint or its rank offset is wrong (rank r publishes on base port + r)",
        "the topic does not match the publisher's (--topic is a prefix)",
        "the engine is idle: no cache change, no batch (publishers without heartbeats are silent)",
    ]
    causes.append(
        "the CURVE keys do not match the publisher's (a refused handshake is silent)"
        if curve
        else "the publisher is encrypted (give --curve-server-key)"
    )
    lines = [f"kvevents listen: nothing received in {seconds:.1f} s from {endpoints}; maybe:"]
    return "\n".join([*lines, *(f"  - {cause}" for cause in causes)])


def _specs(args: argparse.Namespace) -> list[StreamSpec]:
    """Streams named on the command line, then those the ``--engine`` servers advertise."""
    engines = [_engine_streams(text, args.discovery_timeout) for text in args.engine]
    if engines and not (args.endpoints or args.worker):
        specs: list[StreamSpec] = []
    else:
        specs = stream_specs(
            args.endpoints, args.worker, args.replay, ranks=args.ranks, topic=args.topic
        )
    for streams in engines:
        specs += streams
    seen: set[StreamKey] = set()
    for stream in specs:
        if stream.key in seen:
            raise UsageError(f"worker {stream.worker_id} rank {stream.rank} is given twice")
        seen.add(stream.key)
    return specs


def _engine_streams(text: str, timeout: float) -> list[StreamSpec]:
    """``[ID=]URL``: the engine's advertised streams, named ID (default: the URL's host:port)."""
    worker, sep, url = text.partition("=")
    if not sep or "://" in worker:
        worker, url = "", text
    if not worker:
        worker = urllib.parse.urlsplit(url).netloc or url
    engine = discover(url, timeout=timeout)
    print(
        f"{worker}: {engine.ranks} rank(s) at {engine.endpoint}"
        f"{'' if engine.replay_endpoint is None else ', replay ' + engine.replay_endpoint}"
        f", block size {engine.block_size}",
        file=sys.stderr,
        flush=True,
    )
    return engine.streams(worker)


def _feed_dead(sub: Subscriber) -> bool:
    """True (and said on stderr) when the subscriber's I/O thread stopped: nothing more comes,
    so waiting on would only hide it."""
    health = sub.health()
    if health.state != "dead":
        return False
    print(f"kvevents listen: the subscriber stopped: {health.error}", file=sys.stderr, flush=True)
    return True
