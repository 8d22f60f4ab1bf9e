"""Parsing stream arguments of ``kvevents listen``: pure functions, no sockets.

``--worker ID=ENDPOINT[,REPLAY]`` names a worker by its base endpoints (expanded to ``--ranks``
ranks by the WIRE.md rule); ``--worker ID:RANK=ENDPOINT[,REPLAY]`` names one rank's own
endpoints (for publishers bound on ephemeral ports, where the rule cannot apply). Positional
endpoints get worker ids ``w0``, ``w1``... and are paired in order with ``--replay`` values.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.cli.common import UsageError
from kvevents.errors import LayoutError
from kvevents.subscribe.streams import StreamSpec, worker_streams

__all__ = ["parse_worker", "stream_specs"]


def _split_id(text: str, spec: str) -> tuple[str, int | None]:
    worker, sep, rank_text = text.partition(":")
    if not worker:
        raise UsageError(f"--worker {spec!r}: the worker id is empty")
    if not sep:
        return worker, None
    if not (rank_text.isascii() and rank_text.isdigit()):  # isdigit alone takes "²"
        raise UsageError(f"--worker {spec!r}: rank {rank_text!r} is not a number >= 0")
    return worker, int(rank_text)


def parse_worker(spec: str, *, ranks: int = 1, topic: str = "") -> list[StreamSpec]:
    """The streams of one ``--worker ID[:RANK]=ENDPOINT[,REPLAY]`` argument."""
    head, sep, endpoints = spec.partition("=")
    if not sep or not endpoints:
        raise UsageError(f"--worker {spec!r}: expected ID=ENDPOINT[,REPLAY_ENDPOINT]")
    worker, rank = _split_id(head, spec)
    parts = endpoints.split(",")
    if len(parts) > 2 or not all(parts):
        raise UsageError(f"--worker {spec!r}: expected ENDPOINT or ENDPOINT,REPLAY_ENDPOINT")
    replay = parts[1] if len(parts) == 2 else None
    try:
        if rank is not None:
            return [StreamSpec(worker, rank, parts[0], replay, topic)]
        return worker_streams(worker, parts[0], replay, ranks=ranks, topic=topic)
    except LayoutError as exc:
        raise UsageError(f"--worker {spec!r}: {exc}") from None


def _positional(
    endpoints: Sequence[str], replays: Sequence[str], ranks: int, topic: str
) -> list[StreamSpec]:
    if replays and len(replays) != len(endpoints):
        raise UsageError(
            f"{len(replays)} --replay endpoints for {len(endpoints)} endpoints: give one per "
            "endpoint, in the same order"
        )
    specs: list[StreamSpec] = []
    for i, endpoint in enumerate(endpoints):
        replay = replays[i] if replays else None
        try:
            specs += worker_streams(f"w{i}", endpoint, replay, ranks=ranks, topic=topic)
        except LayoutError as exc:
            raise UsageError(str(exc)) from None
    return specs


def stream_specs(
    endpoints: Sequence[str],
    workers: Sequence[str],
    replays: Sequence[str] = (),
    *,
    ranks: int = 1,
    topic: str = "",
) -> list[StreamSpec]:
    """Every stream named on a command line; raises UsageError with a one-line reason."""
    if ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {ranks}")
    if replays and not endpoints:
        raise UsageError("--replay pairs with positional endpoints; use --worker ID=EP,REPLAY")
    specs = _positional(endpoints, replays, ranks, topic)
    for spec in workers:
        specs += parse_worker(spec, ranks=ranks, topic=topic)
    if not specs:
        raise UsageError("no stream to read: give an ENDPOINT or --worker ID=ENDPOINT")
    seen: set[tuple[str, int]] = set()
    for stream in specs:
        if stream.key in seen:
            raise UsageError(f"worker {stream.worker_id} rank {stream.rank} is given twice")
        seen.add(stream.key)
    return specs
