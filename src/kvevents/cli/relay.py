"""``kvevents relay``: engines' ZeroMQ streams into NATS JetStream (``kvevents.scaleout``).

Also the JetStream options ``kvevents serve --nats`` shares with it, and the replica it
builds from them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvevents.cli.common import UsageError, non_negative_int, positive_float, positive_int

EXAMPLES = """examples:
  nats-server -js -sd /var/lib/nats          # a NATS server with JetStream (the nats extra)
  kvevents relay --nats nats://127.0.0.1:4222 --block-size 16 --ranks 2 \\
      --worker a=tcp://10.0.0.5:5557,tcp://10.0.0.5:5600
      every rank of worker "a" into the stream KVEVENTS (created if missing)
  kvevents serve --nats nats://127.0.0.1:4222 --replica-name r1 --port 8090
  kvevents serve --nats nats://127.0.0.1:4222 --replica-name r2 --port 8091
      two router replicas of one index; GET /digest on each shows they agree

Run two relays with the same workers for availability: JetStream drops the copies by their
message ids. See docs/scale-out.md.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "relay",
        help="relay engines' KV events into NATS JetStream",
        description="Subscribe to engines' KV event streams (with gap replay and restart "
        "detection) and append every batch to a NATS JetStream stream that router replicas "
        "(kvevents serve --nats) consume.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nats", required=True, metavar="URL", help="the NATS server")
    p.add_argument("--worker", dest="workers", action="append", default=[], required=True,
                   metavar="ID=EP[,REPLAY]", help="a worker to relay (base endpoints; repeatable)")  # fmt: skip
    p.add_argument("--ranks", type=positive_int, default=1, help="ranks of each --worker")
    p.add_argument("--block-size", type=positive_int, default=16, help="block size of --worker")
    p.add_argument("--metrics-port", type=non_negative_int, metavar="PORT",
                   help="serve /metrics (kvevents_relay_*, kvevents_subscriber_*) on this port")  # fmt: skip
    add_jetstream_options(p)
    p.set_defaults(run=run)


def add_jetstream_options(p: Any) -> None:
    """The stream's options (shared by ``relay`` and ``serve --nats``)."""
    g = p.add_argument_group("NATS JetStream (docs/scale-out.md)")
    g.add_argument("--nats-stream", default="KVEVENTS", metavar="NAME", help="the stream's name")
    g.add_argument("--nats-prefix", default="kvevents", metavar="TOKEN",
                   help="the stream's subjects' first token")  # fmt: skip
    g.add_argument("--nats-bucket", default="kvevents-snapshots", metavar="NAME",
                   help="the object store bucket of snapshots")  # fmt: skip


def add_replica_options(p: Any) -> None:
    """``kvevents serve --nats``: consume the stream as a router replica."""
    g = p.add_argument_group("router replica over NATS JetStream (docs/scale-out.md)")
    g.add_argument("--nats", metavar="URL",
                   help="consume the relay's stream on this NATS server instead of ZeroMQ")  # fmt: skip
    g.add_argument("--replica-name", default="replica", metavar="NAME",
                   help="this replica's durable consumer (unique per replica)")  # fmt: skip
    g.add_argument("--snapshot-batches", type=non_negative_int, default=100_000,
                   help="save a snapshot after this many messages (0: never by count)")  # fmt: skip
    g.add_argument("--snapshot-interval", type=float, default=60.0, metavar="SECONDS",
                   help="save a snapshot after this long (0: never by time)")  # fmt: skip
    g.add_argument("--inactive-threshold", type=positive_float, default=30.0, metavar="SECONDS",
                   help="a stopped replica holds the stream back this long")  # fmt: skip
    g.add_argument("--nats-stream", default="KVEVENTS", metavar="NAME", help="the stream's name")
    g.add_argument("--nats-prefix", default="kvevents", metavar="TOKEN",
                   help="the stream's subjects' first token")  # fmt: skip
    g.add_argument("--nats-bucket", default="kvevents-snapshots", metavar="NAME",
                   help="the object store bucket of snapshots")  # fmt: skip


def jetstream_options(args: argparse.Namespace) -> Any:
    from kvevents.scaleout.jetstream import JetStreamOptions

    return JetStreamOptions(
        stream=args.nats_stream, prefix=args.nats_prefix, bucket=args.nats_bucket
    )


def new_replica(args: argparse.Namespace, **service_options: Any) -> Any:
    """The replica ``serve --nats`` runs (its service made with ``service_options``)."""
    from kvevents.scaleout.replica import Replica, ReplicaOptions

    try:
        options = ReplicaOptions(
            name=args.replica_name,
            snapshot_batches=args.snapshot_batches,
            snapshot_interval=max(args.snapshot_interval, 0.0),
            inactive_threshold=args.inactive_threshold,
        )
        replica = Replica(args.nats, jetstream=jetstream_options(args), options=options,
                          service=None)  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"--replica-name: {exc}") from None
    replica.service = replica.new_service(**service_options)
    return replica


def start_replica(replica: Any) -> None:
    """Start ``replica``; a NATS server that cannot be reached is a one-line error."""
    from kvevents.scaleout.jetstream import StreamConfigError

    try:
        replica.start()
    except StreamConfigError as exc:  # names the stream, what conflicts and the fix
        raise UsageError(f"--nats-stream {replica.js_options.stream}: {exc}") from None
    except Exception as exc:  # the client's own errors: no servers, a refused stream
        raise UsageError(f"--nats {replica.url}: cannot start the replica ({exc!r})") from None


def replica_collector(replica: Any) -> Any:
    from kvevents.metrics import StatsCollector

    return StatsCollector("kvevents_replica", lambda: [({}, replica.stats())])


def _registrations(args: argparse.Namespace) -> list[Any]:
    from kvevents.cli.config import _worker_from_flag
    from kvevents.errors import LayoutError
    from kvevents.scaleout.records import check_registration
    from kvevents.service.feed import WorkerRegistration, default_stream_specs

    regs = []
    for text in args.workers:
        try:
            entry = _worker_from_flag(text)
            reg = WorkerRegistration(entry["id"], entry["endpoint"], args.block_size,
                                     tuple(range(args.ranks)), entry["replay_endpoint"])  # fmt: skip
            default_stream_specs(reg)
            check_registration(reg)  # what replicas accept: the bounds of POST /register
        except (ValueError, LayoutError) as exc:
            raise UsageError(f"--worker: {exc}") from None
        regs.append(reg)
    return regs


def run(args: argparse.Namespace) -> int:
    from kvevents.cli.common import stop_on_sigterm
    from kvevents.scaleout.jetstream import StreamConfigError
    from kvevents.scaleout.relay import Relay

    regs = _registrations(args)
    relay = Relay(args.nats, regs, jetstream=jetstream_options(args))
    with stop_on_sigterm():
        try:
            relay.start()
        except StreamConfigError as exc:  # names the stream, what conflicts and the fix
            relay.close()
            raise UsageError(f"--nats-stream {args.nats_stream}: {exc}") from None
        except Exception as exc:  # the client's own errors: no servers, a refused stream
            relay.close()
            raise UsageError(f"--nats {args.nats}: cannot start the relay ({exc!r})") from None
        print(f"relaying {len(regs)} worker(s) to {args.nats} stream {args.nats_stream}",
              flush=True)  # fmt: skip
        exporter = _metrics(relay, args.metrics_port)
        try:
            _wait()
        except KeyboardInterrupt:
            pass
        finally:
            if exporter is not None:
                exporter.shutdown()
            relay.close()
    stats = relay.stats()
    print(f"stopped: {stats.batches} batches relayed ({stats.duplicates} duplicates dropped, "
          f"{stats.losses} losses recorded)", file=sys.stderr)  # fmt: skip
    return 0


def _metrics(relay: Any, port: int | None) -> Any:
    """The /metrics server of ``--metrics-port`` (None without it)."""
    if port is None:
        return None
    from kvevents.metrics import StatsCollector, start_exporter, subscriber_collector

    relayed = StatsCollector("kvevents_relay", lambda: [({}, relay.stats())])
    server, bound = start_exporter([relayed, subscriber_collector(relay.subscriber)], port)
    print(f"metrics on http://127.0.0.1:{bound}/metrics", flush=True)
    return server


def _wait() -> None:
    import threading

    forever = threading.Event()
    while not forever.wait(3600):
        pass
