"""``kvevents publish``: one simulated engine publishing real KV events, to have something to read."""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvevents._types import Document
from kvevents.cli.common import (
    UsageError,
    non_negative_int,
    positive_float,
    positive_int,
    stop_on_sigterm,
)
from kvevents.cli.config import CONFIG_ENV, PublishSettings, apply_settings, default, track_given
from kvevents.cli.output import JsonOutput
from kvevents.cli.secure import add_server_options, server_curve

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers
    from kvevents.config import KVEventsConfig
    from kvevents.sim import Request, SimulatedEngine

EXAMPLES = """examples:
  kvevents publish
      rank 0 on tcp://*:5557 with replay on tcp://*:5600, synthetic chat-like requests
  kvevents publish --ranks 2 --rate 50 --duration 60
      two ranks (ports 5557-5558, replay 5600-5601), 50 engine steps/s, for a minute
  kvevents publish --trace mooncake_trace.jsonl --endpoint tcp://127.0.0.1:0 --json
      requests from a Mooncake trace on an ephemeral port; the bound endpoints are in the
      first JSON line ("type": "ready")

then, in another terminal:  kvevents listen tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5600
"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "publish",
        help="publish events from a simulated engine",
        description="Run one simulated engine (kvevents.sim._engine) with a real ZeroMQ publisher "
        "per rank, fed with synthetic requests or a Mooncake trace, paced in real time. "
        "Precedence: flags > $KVEVENTS_PUBLISH_<KEY> > the [publish] table of --config > the "
        "defaults (docs/cli.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    track_given(p)
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file, [publish] table (default: ${CONFIG_ENV})",
    )
    p.add_argument("--endpoint", default=_d("endpoint"), help="base PUB endpoint to bind")
    p.add_argument(
        "--replay-endpoint",
        default=_d("replay_endpoint"),
        help="base replay endpoint to bind ('none': no replay)",
    )
    p.add_argument("--ranks", type=positive_int, default=_d("ranks"), help="attention-DP ranks")
    p.add_argument("--topic", default=_d("topic"), help="topic frame of every message")
    p.add_argument(
        "--rate",
        type=positive_float,
        default=_d("rate"),
        help="engine steps per second; each publishes <= 1 batch per rank",
    )
    p.add_argument("--trace", help="Mooncake JSON-lines trace to take requests from")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=_d("concurrency"),
        help="requests kept in flight (default %(default)s)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=_d("block_size"), help="tokens per block"
    )
    p.add_argument(
        "--heartbeat",
        type=positive_float,
        default=_d("heartbeat"),
        help="seconds of silence before an empty batch (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=_d("seed"), help="synthetic workload seed"
    )
    p.add_argument("--count", type=positive_int, help="stop after N batches")
    p.add_argument("--duration", type=positive_float, help="stop after S seconds")
    p.add_argument(
        "--metrics-port",
        type=non_negative_int,
        help="serve Prometheus /metrics of the publishers on this port",
    )
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    add_server_options(p)
    p.set_defaults(run=run)


def _d(key: str) -> Any:  # a field's default: any of the model's field types
    return default(PublishSettings, key)


def synthetic_requests(seed: int, block_size: int) -> Iterator[Request]:
    """Endless chat-like requests: a few shared system prompts, then a private question."""
    from kvevents.sim import Request

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(50_000) for _ in range(block_size * rng.randint(4, 16))] for _ in range(4)
    ]
    for i in itertools.count():
        question = [rng.randrange(50_000) for _ in range(rng.randint(8, block_size * 8))]
        yield Request(f"req-{i}", rng.choice(prompts) + question, rng.randint(4, 48))


def trace_requests(path: str) -> Iterator[Request]:
    """The requests of a Mooncake trace, in file order (arrival times are replaced by --rate)."""
    from kvevents.sim import load_trace, trace_request

    rows = load_trace(path)  # read and checked now, before anything binds
    return (trace_request(row, i) for i, row in enumerate(rows))


def _replay_next_to(endpoint: str, replay: str | None) -> str | None:
    """The default replay endpoint follows an ephemeral publish endpoint: ``--endpoint
    tcp://127.0.0.1:0`` alone must not leave replay on ``tcp://*:5600`` (a fixed port on every
    interface); it gets an ephemeral port on the same host."""
    from kvevents.cli.config import PublishSettings
    from kvevents.errors import LayoutError
    from kvevents.wire import parse_endpoint

    if replay != PublishSettings().replay_endpoint:
        return replay  # chosen by the user
    try:
        parsed = parse_endpoint(endpoint)
    except LayoutError:
        return replay  # the config's own validation names the bad endpoint
    return f"tcp://{parsed.host}:0" if parsed.is_ephemeral else replay


def _config(args: argparse.Namespace) -> KVEventsConfig:
    import pydantic

    from kvevents.config import KVEventsConfig

    replay = None if args.replay_endpoint.lower() == "none" else args.replay_endpoint
    replay = _replay_next_to(args.endpoint, replay)
    try:
        return KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=args.endpoint,
            replay_endpoint=replay,
            topic=args.topic,
        )
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _in_flight(engine: SimulatedEngine) -> int:
    loads = [engine.load(r) for r in range(engine.config.ranks)]
    return sum(load.waiting_requests + load.running_requests for load in loads)


class _Run:
    """The paced loop: keep requests in flight, step, sleep to the next tick."""

    def __init__(
        self, engine: SimulatedEngine, source: Iterator[Request], args: argparse.Namespace
    ) -> None:
        self.engine, self.source, self.args = engine, source, args
        self.exhausted = False
        self.began = time.monotonic()

    def top_up(self) -> None:
        while not self.exhausted and _in_flight(self.engine) < self.args.concurrency:
            request = next(self.source, None)
            if request is None:
                self.exhausted = True
            else:
                self.engine.submit(request)

    def done(self) -> bool:
        args, now = self.args, time.monotonic()
        if args.count is not None and self.engine.metrics().batches >= args.count:
            return True
        if args.duration is not None and now - self.began >= args.duration:
            return True
        return self.exhausted and not self.engine.has_work()

    def loop(self) -> None:
        interval, tick = 1.0 / self.args.rate, time.monotonic()
        while True:
            self.top_up()
            if self.done():
                return
            if self.engine.has_work():
                self.engine.step()
            tick += interval
            time.sleep(max(0.0, tick - time.monotonic()))


def _emit(args: argparse.Namespace, record: Document) -> None:
    if args.json:
        JsonOutput().emit(record)
    elif record["type"] == "ready":
        for r in record["ranks"]:
            replay = f" (replay {r['replay_endpoint']})" if r["replay_endpoint"] else ""
            print(f"rank {r['rank']}: publishing on {r['endpoint']}{replay}", flush=True)
    else:
        print(
            f"published {record['batches']} batches from {record['requests']} requests "
            f"in {record['seconds']:.1f}s",
            flush=True,
        )
        for r in record["ranks"]:
            print(
                f"  rank {r['rank']}: {r['enqueued']} sent, {r['dropped']} dropped, "
                f"{r['heartbeats']} heartbeats, {r['replay_requests']} replay requests",
                flush=True,
            )


# engine: Any in the next three, as its publishers are ZeroMQ ones here (rank, endpoints,
# stats), which the engine's BatchSink type does not say.
def _ready(engine: Any, metrics_port: int | None) -> Document:
    ranks = [
        {"rank": p.rank, "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint}
        for p in engine.publishers
    ]
    return {"type": "ready", "ranks": ranks, "metrics_port": metrics_port}


def _summary(engine: Any, began: float) -> Document:  # see _ready
    ranks = []
    for p in engine.publishers:
        stats = p.stats()
        ranks.append({"rank": p.rank, **stats.as_dict(), "dropped": stats.dropped})
    metrics = engine.metrics()
    return {
        "type": "summary",
        "batches": metrics.batches,
        "requests": metrics.submitted,
        "seconds": round(time.monotonic() - began, 3),
        "ranks": ranks,
    }


def run(args: argparse.Namespace) -> int:
    from kvevents.publish import PublisherOptions
    from kvevents.sim import EngineConfig, SimulatedEngine, zmq_publisher_factory

    args = apply_settings(PublishSettings, "publish", args)
    config = _config(args)
    source = (
        trace_requests(args.trace) if args.trace else synthetic_requests(args.seed, args.block_size)
    )
    options = PublisherOptions(heartbeat_interval=args.heartbeat, curve=server_curve(args))
    engine_config = EngineConfig(block_size=args.block_size, ranks=args.ranks)
    engine = SimulatedEngine(
        engine_config, clock=time.time, publisher_factory=zmq_publisher_factory(config, options)
    )
    with stop_on_sigterm(), engine:
        exporter = _start_metrics(engine, args.metrics_port)
        runner = _Run(engine, source, args)
        _emit(args, _ready(engine, None if exporter is None else exporter[1]))
        try:
            runner.loop()
        except KeyboardInterrupt:
            pass
        finally:
            if exporter is not None:
                exporter[0].shutdown()
    _emit(args, _summary(engine, runner.began))
    return 0


def _start_metrics(
    engine: SimulatedEngine,
    port: int | None,  # see _ready
) -> tuple[Any, int] | None:  # prometheus_client's server (untyped), the port
    if port is None:
        return None
    from kvevents.metrics import publisher_collector, start_exporter

    return start_exporter([publisher_collector(engine.publishers)], port=port, addr="0.0.0.0")
