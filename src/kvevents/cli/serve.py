"""``kvevents serve``: the index service (``kvevents.service.core``) over a live subscriber,
and its HTTP API (``kvevents.http``)."""

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
from kvevents.cli.config import CONFIG_ENV, ServeSettings, apply_settings, default, track_given
from kvevents.cli.relay import add_replica_options, new_replica, replica_collector, start_replica
from kvevents.cli.secure import add_client_options, client_curve

EXAMPLES = """examples:
  kvevents serve
      the index on http://127.0.0.1:8090; workers register with POST /register
  KVEVENTS_AUTH_TOKEN=s3cret kvevents serve --host 0.0.0.0 --port 8090 --block-size 16 \\
      --worker a=tcp://10.0.0.5:5557,tcp://10.0.0.5:5600 --ranks 2
      on every interface (a token is required there, or --allow-unauthenticated), and
      index worker "a" (ranks 0-1) from the start
  kvevents serve --engine sg1=http://10.0.0.5:30000 --engine http://10.0.0.6:30000
      index two SGLang servers from what their /server_info advertises (every DP rank,
      replay, block size, topic); the second is named "10.0.0.6:30000"
  curl -s localhost:8090/query -d '{"token_ids": [1, 2, 3]}'   # then ask it
  curl -s localhost:8090/metrics                                # index + subscriber metrics

  KVEVENTS_AUTH_TOKEN=s3cret kvevents serve --allow-endpoint-host 10.0.0.0/8
      POST /register, /unregister and /load need "Authorization: Bearer s3cret"; workers may
      publish on loopback or 10.x addresses only

  kvevents serve --config serve.toml --state-file state.json
      settings from the [serve] table of a file (docs/cli.md); workers registered over
      HTTP are restored after a restart
  curl -s localhost:8090/load -d '{"loads": [{"worker_id": "a", "rank": 0,
      "queued_blocks": 12, "active_blocks": 300}]}'     # engines' load, for the router

  kvevents serve --nats nats://127.0.0.1:4222 --replica-name r1
      a router replica fed by `kvevents relay` through NATS JetStream (docs/scale-out.md)

endpoints: POST /register /unregister /load /query, GET /dump /workers /metrics /health
/digest (see docs/service.md). A line "serving on URL" goes to stdout once it accepts connections.
Registrations over HTTP may name loopback endpoints only unless --allow-endpoint-host says
otherwise (--worker options are yours and are not checked). Without a token anyone who
reaches the port may register workers (up to the subscriber's 8,192 sockets, 15 metric series
each), so a --host other than loopback needs one or --allow-unauthenticated; see
docs/security.md.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the index HTTP service",
        description="Index KV events from registered workers and answer prefix queries and "
        "routing decisions over HTTP; /metrics serves index and subscriber metrics. "
        "Precedence: flags > $KVEVENTS_SERVE_<KEY> > the [serve] table of --config > the "
        "defaults (docs/cli.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    track_given(p)
    p.add_argument("--config", metavar="FILE",
                   help=f"TOML settings file, [serve] table (default: ${CONFIG_ENV})")  # fmt: skip
    p.add_argument("--host", default=_d("host"), help="address to listen on")
    p.add_argument("--port", type=non_negative_int, default=_d("port"), help="port (0: any free)")
    p.add_argument("--state-file", metavar="PATH",
                   help="keep workers registered over HTTP in PATH, restored at start")  # fmt: skip
    p.add_argument("--worker", dest="workers", action="append", default=[], metavar="ID=EP[,REPLAY]",
                   help="register a worker at start (base endpoints)")  # fmt: skip
    p.add_argument("--ranks", type=positive_int, default=_d("ranks"), help="ranks of each --worker")
    p.add_argument("--block-size", type=positive_int, default=_d("block_size"),
                   help="block size of --worker")  # fmt: skip
    _add_engine_options(p)
    p.add_argument("--api", choices=("kvevents", "dynamo"), default=_d("api"),
                   help="request and reply shapes of /register, /unregister, /query and /workers: "
                   "ours, or NVIDIA Dynamo's standalone indexer's (docs/service.md)")  # fmt: skip
    _add_router_options(p)
    _add_access_options(p)
    _add_limit_options(p)
    add_client_options(p)
    add_replica_options(p)
    p.set_defaults(run=run)


def _d(key: str) -> Any:
    return default(ServeSettings, key)


def _add_engine_options(p: Any) -> None:
    p.add_argument("--engine", dest="engines", action="append", default=_d("engines"),
                   metavar="[ID=]URL", help="register an engine's advertised streams (SGLang's /server_info) at "
                   "start, named ID (default: the URL's host:port); repeatable")  # fmt: skip
    p.add_argument(
        "--discovery-timeout",
        type=positive_float,
        default=_d("discovery_timeout"),
        help="seconds an engine's /server_info may take in all: connect, headers, body (default 5)",
    )


def _add_router_options(p: Any) -> None:
    g = p.add_argument_group("routing (see kvevents.index.router)")
    # The policy names come from the settings model, not the index (the parser must build
    # without the service extra); a test holds the two together.
    g.add_argument("--policy", default=_d("policy"),
                   help=f"routing policy (default: {_d('policy')})")  # fmt: skip
    g.add_argument("--seed", type=non_negative_int, default=_d("seed"),
                   help="seed of the policies' random tie-breaks")  # fmt: skip
    g.add_argument("--prefill-weight", type=float, default=_d("prefill_weight"),
                   help="prefix_load: weight of the prefill blocks")  # fmt: skip
    g.add_argument("--load-weight", type=float, default=_d("load_weight"),
                   help="prefix_load: weight of the reported load")  # fmt: skip
    g.add_argument("--load-ttl", type=positive_float, default=_d("load_ttl"),
                   help="seconds a POST /load report counts for (default: %(default)s)")  # fmt: skip


def _add_access_options(p: Any) -> None:
    p.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="bearer token for /register, /unregister and /load (default: $KVEVENTS_AUTH_TOKEN; "
        "neither: no authentication, and anyone who reaches the port may register workers: "
        "thousands of streams and metric series; refused on a --host other than loopback "
        "unless --allow-unauthenticated)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a --host other than loopback without a token (behind a proxy or "
        "firewall that does the authentication)",
    )
    p.add_argument("--auth-reads", action="store_true",
                   help="require the token on the read-only endpoints too")  # fmt: skip
    p.add_argument("--allow-endpoint-host", action="append", default=[], metavar="HOST",
                   help="a host, address, CIDR, '*' or 'ipc' that registered endpoints may "
                   "name (repeatable; default: loopback only)")  # fmt: skip


def _add_limit_options(p: Any) -> None:
    p.add_argument("--max-body-bytes", type=positive_int, default=_d("max_body_bytes"),
                   help="largest request body (413 above)")  # fmt: skip
    p.add_argument("--header-timeout", type=positive_float, default=_d("header_timeout"),
                   help="seconds a connection has to send a request's headers")  # fmt: skip
    p.add_argument("--body-timeout", type=positive_float, default=_d("body_timeout"),
                   help="seconds a request has to send its body (408 after)")  # fmt: skip
    p.add_argument("--max-connections", type=positive_int, default=_d("max_connections"),
                   help="open HTTP connections; more are closed at once")  # fmt: skip
    p.add_argument(
        "--send-timeout",
        type=positive_float,
        default=_d("send_timeout"),
        help="seconds a response may wait for a client that reads nothing; its connection is "
        "closed after",
    )


def _app_options(args: argparse.Namespace) -> Any:
    from kvevents.http import (
        DEFAULT_ALLOWED_HOSTS,
        AppOptions,
        EndpointPolicy,
        HttpLimits,
        TokenCheck,
    )

    token = _token(args.auth_token_file)
    if token is None and not args.allow_unauthenticated:
        _refuse_exposed(args.host)
    if args.auth_reads and token is None:
        raise UsageError("--auth-reads needs a token (--auth-token-file or $KVEVENTS_AUTH_TOKEN)")
    hosts = tuple(args.allow_endpoint_host) or DEFAULT_ALLOWED_HOSTS
    limits = HttpLimits(
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        send_timeout=args.send_timeout,
    )
    return AppOptions(TokenCheck(token, args.auth_reads), EndpointPolicy(hosts), limits, args.api)


def _token(path: str | None) -> str | None:
    """The bearer token (None: no authentication); a warning when others may read its file."""
    from kvevents.http import exposed_mode, load_token

    try:
        token = load_token(path)
        mode = None if path is None else exposed_mode(path)
    except OSError as exc:
        raise UsageError(f"--auth-token-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--auth-token-file: {exc}") from None
    if mode is not None:
        why = f"may be read by others than its owner (mode {mode:04o}): chmod 600 {path}"
        print(f"kvevents serve: warning: --auth-token-file {path} {why}", file=sys.stderr)
    return token


def _refuse_exposed(host: str) -> None:
    """UsageError unless ``host`` is loopback: without a token, anyone who reaches the port
    may register (and unregister) workers; on loopback that is a local process only."""
    from kvevents.http import is_loopback

    if not is_loopback(host):
        raise UsageError(
            f"--host {host} is not a loopback address and no token is set: anyone who can "
            "reach the port could register and unregister workers and report loads. Set a token "
            "(--auth-token-file FILE or $KVEVENTS_AUTH_TOKEN), or give "
            "--allow-unauthenticated to serve without one"
        )


def _registrations(settings: ServeSettings) -> list[Any]:
    from kvevents.errors import LayoutError
    from kvevents.service.core import WorkerRegistration
    from kvevents.service.feed import default_stream_specs

    regs = []
    for entry in settings.workers:
        reg = WorkerRegistration(entry.id, entry.endpoint, entry.block_size or settings.block_size,
                                 entry.rank_numbers(settings.ranks), entry.replay_endpoint)  # fmt: skip
        try:
            default_stream_specs(reg)  # every rank's endpoint, derived by the WIRE.md rule
        except LayoutError as exc:
            raise UsageError(f"worker {entry.id!r}: {exc}") from None
        regs.append(reg)
    return regs


def _engine_registrations(settings: ServeSettings, taken: set[str]) -> list[Any]:
    """One registration per ``--engine``, from what it advertises; a DiscoveryError (the URL
    and why: unreachable, no KV events, a bad field) stops the start (exit status 1)."""
    from kvevents.bounds import MAX_NAME_LENGTH
    from kvevents.integrations.discovery import discover, engine_option
    from kvevents.service.core import WorkerRegistration

    regs = []
    for text in settings.engines:
        worker, url = engine_option(text)
        if worker in taken:
            raise UsageError(f"worker {worker!r} is given twice")
        if len(worker) > MAX_NAME_LENGTH:  # the bound of a worker id over HTTP
            raise UsageError(f"--engine: the worker id is over {MAX_NAME_LENGTH} characters")
        taken.add(worker)
        engine = discover(url, timeout=settings.discovery_timeout)
        replay = "" if engine.replay_endpoint is None else f", replay {engine.replay_endpoint}"
        print(f"{worker}: {engine.ranks} rank(s) at {engine.endpoint}{replay}, block size "
              f"{engine.block_size}", file=sys.stderr, flush=True)  # fmt: skip
        regs.append(WorkerRegistration(**engine.registration_fields(worker)))
    return regs


def _state(settings: ServeSettings) -> tuple[Any, list[Any]]:
    """The state file (None without --state-file) and the registrations saved in it."""
    if settings.state_file is None:
        return None, []
    from kvevents.service.state import StateFile

    state = StateFile(settings.state_file)
    saved = state.load()  # StateFileError (a ValueError) names the file: exit status 1
    state.check_writable()
    state.remove_stale_temporaries()  # of a serve killed while it wrote
    return state, saved


def _restore(service: Any, saved: list[Any], policy: Any) -> None:
    """Register the state file's workers again, as if over HTTP: the endpoint policy of now
    applies. One refused is skipped with a warning (and leaves the file at the next change).
    The file is not written meanwhile, and /health says "starting" until the end."""

    def check(spec: Any) -> None:  # each rank's own endpoints too
        for name in ("endpoint", "replay_endpoint"):
            if getattr(spec, name) is not None:
                policy.check(name, getattr(spec, name), (0,))

    for reg, exc in service.restore(saved, check):
        why = f"state file: worker {reg.worker_id!r} not restored: {exc}"
        print(f"kvevents serve: warning: {why}", file=sys.stderr, flush=True)


def _service(settings: ServeSettings, args: argparse.Namespace, state: Any) -> Any:
    from kvevents.index.prefix import PrefixIndex
    from kvevents.index.router import Router
    from kvevents.service.core import IndexService
    from kvevents.subscribe.streams import SubscriberOptions

    index = PrefixIndex()
    router = Router(index, settings.policy, seed=settings.seed,
                    prefill_weight=settings.prefill_weight, load_weight=settings.load_weight)  # fmt: skip
    # The default feed: a Subscriber applying each batch on its own I/O thread.
    options = SubscriberOptions(curve=client_curve(args))
    return IndexService(index, router=router, subscriber_options=options,
                        load_ttl=settings.load_ttl, state=state)  # fmt: skip


def _replica(settings: ServeSettings, args: argparse.Namespace, regs: list[Any]) -> Any:
    """``--nats``: the replica whose service answers (workers come from the relay)."""
    from kvevents.index.prefix import PrefixIndex
    from kvevents.index.router import Router

    if regs or settings.state_file is not None:
        raise UsageError("--nats: workers are registered with the relay (kvevents relay), "
                         "not with --worker or --state-file")  # fmt: skip
    index = PrefixIndex()
    router = Router(index, settings.policy, seed=settings.seed,
                    prefill_weight=settings.prefill_weight, load_weight=settings.load_weight)  # fmt: skip
    return new_replica(args, index=index, router=router, load_ttl=settings.load_ttl)


def _digest_extra(replica: Any) -> Any:
    """A replica's ``covered_seq`` in ``GET /digest``; nothing more for a plain service."""
    if replica is None:
        return None
    return lambda: {"covered_seq": replica.covered_seq}


def run(args: argparse.Namespace) -> int:
    from kvevents.http import serve
    from kvevents.metrics import subscriber_collector

    args = apply_settings(ServeSettings, "serve", args)
    settings: ServeSettings = args.settings
    regs = _registrations(settings)
    app_options = _app_options(args)  # before discovery: a refused start waits for no engine
    regs += _engine_registrations(settings, {reg.worker_id for reg in regs})
    state, saved = _state(settings)
    replica = _replica(settings, args, regs) if args.nats else None
    service = _service(settings, args, state) if replica is None else replica.service
    feed = service.feed
    collectors = [subscriber_collector(feed) if replica is None else replica_collector(replica)]
    with stop_on_sigterm():
        if replica is not None:
            start_replica(replica)  # the snapshot is loaded before the first query is answered
        server = serve(
            settings.host,
            settings.port,
            service=service,
            options=app_options,
            collectors=collectors,
            digest_extra=_digest_extra(replica),
        )
        try:
            _restore(service, saved, app_options.endpoints.with_forbidden_port(server.port))
            for reg in regs:
                service.register(reg, persist=False)  # the settings' own: not in the state file
            print(f"serving on {server.url}", flush=True)
            server.wait()
        finally:
            server.close()
            if replica is not None:
                replica.close()
    stats = service.stats()
    print(f"stopped: {stats.deliveries} batches applied, {stats.queries} queries", file=sys.stderr)
    return 0
