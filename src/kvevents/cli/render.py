"""What ``kvevents listen`` shows: records for subscriber items, as JSON or text. Pure code.

Every item becomes one or more records (plain dicts with a ``type``): ``batch`` for each
delivered batch, and call-outs for what a person watching must notice: ``gap`` (a hole was
found and is being replayed; ``after_seq`` is the last batch delivered before it, null on a
late join), ``replayed`` (the replay filled it: ``first``..``last``), ``unrecoverable`` (the
batches ``missing[0]``..``missing[1] - 1`` are lost for good), ``complete`` (the stream is
whole again), ``restart`` (the publisher restarted; the view is rebuilt from seq 0) and
``removed``. :func:`text_line` renders any record as one line for a terminal or a log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from kvevents._types import Document, DocumentView
from kvevents.cli.common import plural
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, StreamKey
from kvevents.subscribe import Delivery, StreamReset, StreamSpec, StreamStats, StreamStatus

__all__ = ["ListenView", "batch_summary", "stats_record", "text_line"]

Record = Document


def batch_summary(batch: KVEventBatch) -> dict[str, int]:
    """Counts of one batch: events, blocks stored, blocks removed, clears."""
    stored = removed = cleared = 0
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed += len(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cleared += 1
    return {"events": len(batch.events), "stored": stored, "removed": removed, "cleared": cleared}


def _stream_fields(stream: StreamSpec) -> Record:
    return {"worker": stream.worker_id, "rank": stream.rank}


@dataclass
class _Track:
    """What the view remembers of one stream to phrase its call-outs."""

    last_seq: int | None = None
    state: str = "new"
    replayed: list[int] = field(default_factory=list)


class ListenView:
    """Turns subscriber items into records, in the order they arrive.

    Feed it with ``status_items=True`` so statuses arrive in order with the deliveries.
    """

    def __init__(self, *, full: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.full = full
        self.clock = clock
        self.batches = 0
        self._tracks: dict[StreamKey, _Track] = {}

    def records(self, item: Delivery | StreamReset | StreamStatus) -> list[Record]:
        """The records one item produces (a delivery always gives exactly one ``batch``)."""
        track = self._tracks.setdefault(item.stream.key, _Track())
        if isinstance(item, Delivery):
            return [self._batch(item, track)]
        if isinstance(item, StreamReset):
            track.last_seq, track.replayed = None, []
            return [{"type": item.reason, **_stream_fields(item.stream)}]
        return self._status(item, track)

    def _batch(self, item: Delivery, track: _Track) -> Record:
        self.batches += 1
        track.last_seq = item.seq
        if track.state == "replaying":
            track.replayed.append(item.seq)
        batch = item.batch
        record: Record = {
            "type": "batch",
            **_stream_fields(item.stream),
            "seq": item.seq,
            "ts": batch.ts,
            "lag": round(self.clock() - batch.ts, 6),
            "summary": batch_summary(batch),
        }
        if self.full:
            record["events"] = msgspec.to_builtins(batch.events)
        return record

    def _status(self, item: StreamStatus, track: _Track) -> list[Record]:
        before, track.state = track.state, item.state
        base = _stream_fields(item.stream)
        out: list[Record] = []
        if before == "replaying" and track.replayed:
            first, last = track.replayed[0], track.replayed[-1]
            out.append(
                {
                    "type": "replayed",
                    **base,
                    "first": first,
                    "last": last,
                    "batches": len(track.replayed),
                }
            )
        track.replayed = []
        if item.state == "replaying":
            out.append({"type": "gap", **base, "after_seq": track.last_seq})
        elif item.state == "incomplete" and item.missing is not None:
            out.append({"type": "unrecoverable", **base, "missing": list(item.missing)})
        elif item.state == "live" and before == "incomplete":
            out.append({"type": "complete", **base})
        return out


def stats_record(stats: Mapping[StreamKey, StreamStats], batches: int, seconds: float) -> Record:
    """The final ``summary`` record: what was shown, and every stream's counters."""
    streams = [dataclasses.asdict(s) for _, s in sorted(stats.items())]
    return {"type": "summary", "batches": batches, "seconds": round(seconds, 3), "streams": streams}


def _where(record: Record) -> str:
    return f"{record['worker']}/{record['rank']}"


def _batch_text(r: Record) -> str:
    s = r["summary"]
    parts = [f"{_where(r)} seq={r['seq']}", f"events={s['events']}"]
    parts += [f"+{s['stored']} stored"] if s["stored"] else []
    parts += [f"-{s['removed']} removed"] if s["removed"] else []
    parts += ["CLEARED"] if s["cleared"] else []
    parts.append(f"lag={r['lag'] * 1000:.1f}ms")
    return "\n".join([" ".join(parts), *event_lines(r)])


def event_lines(r: Record) -> list[str]:
    """With ``--full``: one indented line per event of a batch record (none without it)."""
    return [f"    {_event_text(event)}" for event in r.get("events", ())]


def _event_text(event: DocumentView) -> str:
    kind = event.get("type", "?")
    if kind == "BlockStored":
        hashes = event["block_hashes"]
        return (
            f"BlockStored {plural(len(hashes), 'block')} parent={event.get('parent_block_hash')} "
            f"block_size={event.get('block_size')} medium={event.get('medium')} "
            f"hashes={hashes} tokens={plural(len(event.get('token_ids', ())), 'token')}"
        )
    if kind == "BlockRemoved":
        return f"BlockRemoved medium={event.get('medium')} hashes={event['block_hashes']}"
    return str(kind)


def _summary_text(r: Record) -> str:
    lines = [f"summary: {plural(r['batches'], 'batch')} shown in {r['seconds']:.1f}s"]
    for s in r["streams"]:
        last = "no batch yet" if s["last_seq"] is None else f"last seq {s['last_seq']}"
        lines.append(
            f"  {s['worker_id']}/{s['rank']}: {s['state']}, {s['delivered']} delivered "
            f"({s['replayed']} replayed), {last}, {plural(s['gaps'], 'gap')}, "
            f"{s['missing']} lost in {plural(s['unrecoverable'], 'hole')}, "
            f"{plural(s['restarts'], 'restart')}, {plural(s['duplicates'], 'duplicate')}, "
            f"{s['decode_errors']} undecodable"
        )
    return "\n".join(lines)


def text_line(r: Record) -> str:
    """One human line for a record (the summary takes one line per stream)."""
    kind = r["type"]
    if kind == "batch":
        return _batch_text(r)
    if kind == "summary":
        return _summary_text(r)
    where = _where(r)
    if kind == "gap":
        after = r["after_seq"]
        hole = "joined late" if after is None else f"gap after seq {after}"
        return f"{where} ! {hole}: replaying"
    if kind == "replayed":
        return f"{where} ! replayed seq {r['first']}..{r['last']} ({plural(r['batches'], 'batch')})"
    if kind == "unrecoverable":
        start, end = r["missing"]
        return f"{where} !! seq {start}..{end - 1} lost for good: view incomplete"
    if kind == "complete":
        return f"{where} ! complete again"
    if kind == "restart":
        return f"{where} !! publisher restarted: view dropped, rebuilding from seq 0"
    return f"{where} ! {kind}"
