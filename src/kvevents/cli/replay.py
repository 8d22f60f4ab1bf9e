"""``kvevents replay``: fetch a range of batches from a publisher's replay endpoint."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvevents._types import Document
from kvevents.cli.common import UsageError, non_negative_int, plural, positive_float
from kvevents.cli.output import JsonOutput
from kvevents.cli.render import batch_summary, event_lines
from kvevents.cli.secure import add_client_options, client_curve
from kvevents.errors import DecodeError, LayoutError
from kvevents.wire import (
    ReplayMessage,
    decode_batch,
    parse_endpoint,
    parse_replay_reply,
    replay_request_frames,
)

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers
    from kvevents.security import CurveClient

EXAMPLES = """examples:
  kvevents replay tcp://10.0.0.5:5600 --from 0
      everything the publisher still holds
  kvevents replay tcp://10.0.0.5:5601 --from 1200 --to 1250 --json --full
      rank 1's batches 1200..1250 (inclusive) as JSON lines with every event

output:
  one line (or JSON object, "type": "batch") per batch, in sequence order; "trimmed" when the
  first batch is later than asked (the publisher no longer holds the start), then "end"
  (the end marker arrived, or --to was reached). Exit status: 0 when the whole range came,
  3 when it was trimmed, 1 when the endpoint did not answer within --timeout.
"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "replay",
        help="fetch a range of batches from a replay endpoint",
        description="Ask a publisher's replay (ROUTER) endpoint for the batches from --from "
        "on, with a DEALER socket, and print them.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("endpoint", metavar="ENDPOINT", help="the rank's replay endpoint")
    p.add_argument(
        "--from",
        dest="start",
        type=non_negative_int,
        required=True,
        metavar="SEQ",
        help="first sequence number wanted",
    )
    p.add_argument(
        "--to",
        dest="stop",
        type=non_negative_int,
        metavar="SEQ",
        help="last sequence number wanted (inclusive; default: all held)",
    )
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    p.add_argument("--full", action="store_true", help="include every event, not only counts")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for each message (default 5)",
    )
    add_client_options(p)
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    if args.stop is not None and args.stop < args.start:
        raise UsageError(f"--to {args.stop} is before --from {args.start}")
    try:
        parsed = parse_endpoint(args.endpoint)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    if parsed.scheme == "tcp" and (parsed.host == "*" or parsed.port == 0):
        raise UsageError(f"{args.endpoint}: give the publisher's host and bound port")


def fetch(
    endpoint: str, start: int, timeout: float, curve: CurveClient | None = None
) -> Iterator[ReplayMessage]:
    """Replay messages for ``seq >= start`` until the end marker (included)."""
    import zmq

    from kvevents.security import apply_client

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if "[" in endpoint:
        dealer.setsockopt(zmq.IPV6, 1)
    apply_client(dealer, curve)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request_frames(start))
        while True:
            if not dealer.poll(int(timeout * 1000)):
                raise TimeoutError(f"no reply from {endpoint} within {timeout:g}s")
            message = parse_replay_reply(dealer.recv_multipart())
            yield message
            if message.is_end:
                return
    finally:
        dealer.close(0)
        context.term()


def _batch_record(message: ReplayMessage, full: bool) -> Document:
    try:
        batch = decode_batch(message.payload, seq=message.seq).batch
    except DecodeError as exc:
        return {"type": "undecodable", "seq": message.seq, "error": str(exc)}
    record: Document = {
        "type": "batch",
        "seq": message.seq,
        "ts": batch.ts,
        "rank": batch.data_parallel_rank,
        "summary": batch_summary(batch),
    }
    if full:
        import msgspec

        record["events"] = msgspec.to_builtins(batch.events)
    return record


def _line(record: Document) -> str:
    kind = record["type"]
    if kind == "batch":
        s = record["summary"]
        head = (
            f"seq={record['seq']} ts={record['ts']:.3f} events={s['events']} "
            f"+{s['stored']} stored -{s['removed']} removed" + (" CLEARED" if s["cleared"] else "")
        )
        return "\n".join([head, *event_lines(record)])
    if kind == "trimmed":
        return (
            f"! asked from seq {record['asked']}, first held is {record['first']}: "
            f"{record['asked']}..{record['first'] - 1} are no longer buffered"
        )
    if kind == "undecodable":
        return f"! seq {record['seq']} undecodable: {record['error']}"
    reason = "end marker" if record["end_marker"] else "--to reached"
    return f"end: {plural(record['batches'], 'batch')}, {reason}"


def run(args: argparse.Namespace) -> int:
    _check(args)
    curve = client_curve(args)
    emit = JsonOutput().emit if args.json else (lambda r: print(_line(r), flush=True))
    count, first, trimmed, end_marker = 0, True, False, False
    began = time.monotonic()
    for message in fetch(args.endpoint, args.start, args.timeout, curve):
        if message.is_end:
            end_marker = True
            break
        if args.stop is not None and message.seq > args.stop:
            break
        if first and message.seq > args.start:
            trimmed = True
            emit({"type": "trimmed", "asked": args.start, "first": message.seq})
        first = False
        count += 1
        emit(_batch_record(message, args.full))
    emit(
        {
            "type": "end",
            "batches": count,
            "end_marker": end_marker,
            "seconds": round(time.monotonic() - began, 3),
        }
    )
    if trimmed:
        print(f"kvevents replay: range trimmed at {args.endpoint}", file=sys.stderr)
    return 3 if trimmed else 0
