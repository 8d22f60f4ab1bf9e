"""``kvevents serve``: the index HTTP service (``kvevents.service.core``) over a live subscriber."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvevents.cli.common import UsageError, non_negative_int, positive_int, stop_on_sigterm
from kvevents.cli.secure import add_client_options, client_curve

EXAMPLES = """examples:
  kvevents serve
      the index on http://127.0.0.1:8090; workers register with POST /register
  kvevents serve --host 0.0.0.0 --port 8090 --block-size 16 \\
      --worker a=tcp://10.0.0.5:5557,tcp://10.0.0.5:5600 --ranks 2
      and index worker "a" (ranks 0-1) from the start
  curl -s localhost:8090/query -d '{"token_ids": [1, 2, 3]}'   # then ask it
  curl -s localhost:8090/metrics                                # index + subscriber metrics

endpoints: POST /register /unregister /query, GET /dump /workers /metrics /health
(see docs/index.md). A line "serving on URL" goes to stdout once it accepts connections.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the index HTTP service",
        description="Index KV events from registered workers and answer prefix queries and "
        "routing decisions over HTTP; /metrics serves index and subscriber metrics.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=non_negative_int, default=8090, help="port (0: any free)")
    p.add_argument("--policy", default="prefix_load", help="default routing policy")
    p.add_argument("--worker", action="append", default=[], metavar="ID=EP[,REPLAY]",
                   help="register a worker at start (base endpoints)")  # fmt: skip
    p.add_argument("--ranks", type=positive_int, default=1, help="ranks of each --worker")
    p.add_argument("--block-size", type=positive_int, default=16, help="block size of --worker")
    add_client_options(p)
    p.set_defaults(run=run)


def _registrations(args: argparse.Namespace) -> list[Any]:
    from kvevents.cli.specs import parse_worker
    from kvevents.service.core import WorkerRegistration

    regs = []
    for text in args.worker:
        specs = parse_worker(text, ranks=args.ranks)  # validates the endpoints
        if ":" in text.partition("=")[0]:
            raise UsageError(f"--worker {text!r}: serve registers base endpoints, not one rank")
        endpoint, _, replay = text.partition("=")[2].partition(",")
        regs.append(WorkerRegistration(specs[0].worker_id, endpoint, args.block_size,
                                       tuple(range(args.ranks)), replay or None))  # fmt: skip
    return regs


def run(args: argparse.Namespace) -> int:
    from kvevents.index.router import POLICIES
    from kvevents.metrics import subscriber_collector
    from kvevents.service.core import IndexService
    from kvevents.service.http import serve
    from kvevents.subscribe.streams import SubscriberOptions

    if args.policy not in POLICIES:
        raise UsageError(f"--policy {args.policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    regs = _registrations(args)
    # The default feed: a Subscriber applying each batch on its own I/O thread.
    options = SubscriberOptions(curve=client_curve(args))
    service = IndexService(policy=args.policy, subscriber_options=options)
    feed = service.feed
    with stop_on_sigterm():
        server = serve(args.host, args.port, service=service,
                       collectors=[subscriber_collector(feed)])  # fmt: skip
        try:
            for reg in regs:
                service.register(reg)
            print(f"serving on {server.url}", flush=True)
            server.wait()
        finally:
            server.close()
    stats = service.stats()
    print(f"stopped: {stats.deliveries} batches applied, {stats.queries} queries", file=sys.stderr)
    return 0
