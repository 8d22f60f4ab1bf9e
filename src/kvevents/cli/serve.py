"""``kvevents serve``: the index HTTP service (``kvevents.service.core``) over a live subscriber."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvevents.cli.common import (
    UsageError,
    non_negative_int,
    positive_float,
    positive_int,
    stop_on_sigterm,
)
from kvevents.cli.secure import add_client_options, client_curve

EXAMPLES = """examples:
  kvevents serve
      the index on http://127.0.0.1:8090; workers register with POST /register
  kvevents serve --host 0.0.0.0 --port 8090 --block-size 16 \\
      --worker a=tcp://10.0.0.5:5557,tcp://10.0.0.5:5600 --ranks 2
      and index worker "a" (ranks 0-1) from the start
  curl -s localhost:8090/query -d '{"token_ids": [1, 2, 3]}'   # then ask it
  curl -s localhost:8090/metrics                                # index + subscriber metrics

  KVEVENTS_AUTH_TOKEN=s3cret kvevents serve --allow-endpoint-host 10.0.0.0/8
      POST /register and /unregister need "Authorization: Bearer s3cret"; workers may
      publish on loopback or 10.x addresses only

endpoints: POST /register /unregister /query, GET /dump /workers /metrics /health
(see docs/service.md). A line "serving on URL" goes to stdout once it accepts connections.
Registrations over HTTP may name loopback endpoints only unless --allow-endpoint-host says
otherwise (--worker options are yours and are not checked); see docs/security.md.
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
    # The router's default, named here without importing the index (the parser must build
    # without the service extra); a test holds the two together.
    p.add_argument(
        "--policy", default="longest_prefix", help="routing policy (default: longest_prefix)"
    )
    p.add_argument("--worker", action="append", default=[], metavar="ID=EP[,REPLAY]",
                   help="register a worker at start (base endpoints)")  # fmt: skip
    p.add_argument("--ranks", type=positive_int, default=1, help="ranks of each --worker")
    p.add_argument("--block-size", type=positive_int, default=16, help="block size of --worker")
    _add_access_options(p)
    _add_limit_options(p)
    add_client_options(p)
    p.set_defaults(run=run)


def _add_access_options(p: Any) -> None:
    p.add_argument("--auth-token-file", metavar="FILE",
                   help="bearer token for /register and /unregister (default: "
                   "$KVEVENTS_AUTH_TOKEN; neither: no authentication)")  # fmt: skip
    p.add_argument("--auth-reads", action="store_true",
                   help="require the token on the read-only endpoints too")  # fmt: skip
    p.add_argument("--allow-endpoint-host", action="append", default=[], metavar="HOST",
                   help="a host, address, CIDR, '*' or 'ipc' that registered endpoints may "
                   "name (repeatable; default: loopback only)")  # fmt: skip


def _add_limit_options(p: Any) -> None:
    p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20,
                   help="largest request body (413 above)")  # fmt: skip
    p.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds a connection has to send a request's headers")  # fmt: skip
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request has to send its body (408 after)")  # fmt: skip
    p.add_argument("--max-connections", type=positive_int, default=256,
                   help="open HTTP connections; more are closed at once")  # fmt: skip


def _app_options(args: argparse.Namespace) -> Any:
    from kvevents.service.access import DEFAULT_ALLOWED_HOSTS, load_token
    from kvevents.service.http import AppOptions, EndpointPolicy, HttpLimits, TokenCheck

    try:
        token = load_token(args.auth_token_file)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--auth-token-file: {exc}") from None
    if args.auth_reads and token is None:
        raise UsageError("--auth-reads needs a token (--auth-token-file or $KVEVENTS_AUTH_TOKEN)")
    hosts = tuple(args.allow_endpoint_host) or DEFAULT_ALLOWED_HOSTS
    limits = HttpLimits(args.max_body_bytes, args.header_timeout, args.body_timeout,
                        args.max_connections)  # fmt: skip
    return AppOptions(TokenCheck(token, args.auth_reads), EndpointPolicy(hosts), limits)


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
    app_options = _app_options(args)
    # The default feed: a Subscriber applying each batch on its own I/O thread.
    options = SubscriberOptions(curve=client_curve(args))
    service = IndexService(policy=args.policy, subscriber_options=options)
    feed = service.feed
    with stop_on_sigterm():
        server = serve(args.host, args.port, service=service, options=app_options,
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
