"""What a relay writes to JetStream and a replica reads back: subjects, headers, message ids.

Pure: no sockets, no NATS client. One JetStream message carries one engine batch (its payload
as the engine sent it) or one record about a stream:

============  ==========================================  ====================================
kind          subject                                     means
============  ==========================================  ====================================
``batch``     ``<prefix>.ev.<worker>.<rank>``             apply this engine batch (``seq``)
``reset``     ``<prefix>.ev.<worker>.<rank>``             the engine restarted: drop the
                                                          stream; its first batch is ``seq``
``loss``      ``<prefix>.ev.<worker>.<rank>``             batches ``seq`` .. ``end - 1`` were
                                                          lost for good (the relay could not
                                                          replay them)
``live``      ``<prefix>.ev.<worker>.<rank>``             the stream is whole again
``worker``    ``<prefix>.reg.<worker>``                   a worker's registration (JSON body)
============  ==========================================  ====================================

Records of one stream share its subject, so JetStream keeps them in the order the relay saw
them. Every message has a ``Nats-Msg-Id`` built from what the engine sent, never from the
relay's own state: a batch's id is ``worker/rank/seq/<digest of its payload>``. Two relays
reading one engine, or a relay restarted and replaying, write the same ids, and JetStream
drops the copies inside its duplicate window. The payload digest stands in for the engine's
incarnation: a restarted engine numbers from 0 again, but its batches differ (their ``ts``
at least), so they get new ids. Beyond the window the replica's own cursor
(:mod:`kvevents.scaleout.cursor`) drops the copies.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal, TypeAlias
from urllib.parse import quote, unquote

from kvevents.service.feed import WorkerRegistration

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_STREAM",
    "RecordError",
    "RecordKind",
    "RelayRecord",
    "batch_record",
    "live_record",
    "loss_record",
    "parse_record",
    "payload_digest",
    "reset_record",
    "worker_record",
]

#: The JetStream stream name and the subject prefix used by default.
DEFAULT_STREAM = "KVEVENTS"
DEFAULT_PREFIX = "kvevents"

RecordKind: TypeAlias = Literal["batch", "reset", "loss", "live", "worker"]
_KINDS: frozenset[str] = frozenset({"batch", "reset", "loss", "live", "worker"})

# Header names. Values are ASCII; a worker id is percent-encoded (it may hold anything).
H_ID = "Nats-Msg-Id"
H_KIND = "Kv-Kind"
H_WORKER = "Kv-Worker"
H_RANK = "Kv-Rank"
H_SEQ = "Kv-Seq"
H_END = "Kv-End"
H_DIGEST = "Kv-Digest"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RecordError(ValueError):
    """A message is not a relay record; ``field`` names the header (or the body) at fault."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def payload_digest(payload: bytes) -> str:
    """16 hex digits identifying a batch payload (its content, hence its incarnation)."""
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def subject_token(worker_id: str) -> str:
    """A subject token for ``worker_id``: itself when it is a plain name, else ``~`` and the
    hex of its UTF-8 (NATS tokens cannot hold ``.``, ``*``, ``>`` or white space)."""
    if _TOKEN.fullmatch(worker_id):
        return worker_id
    return "~" + worker_id.encode().hex()[:96]


def stream_subject(prefix: str, worker_id: str, rank: int) -> str:
    return f"{prefix}.ev.{subject_token(worker_id)}.{rank}"


def worker_subject(prefix: str, worker_id: str) -> str:
    return f"{prefix}.reg.{subject_token(worker_id)}"


@dataclass(frozen=True)
class RelayRecord:
    """One message, read back: its kind, stream, numbers and body (the engine payload of a
    ``batch``, the registration JSON of a ``worker``, empty otherwise)."""

    kind: RecordKind
    worker_id: str
    rank: int
    seq: int = 0
    end: int = 0
    digest: str = ""
    body: bytes = b""

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker_id, self.rank)

    def registration(self) -> WorkerRegistration:
        """The registration a ``worker`` record carries; RecordError if it is not one."""
        return _registration(self.body)


Outgoing: TypeAlias = tuple[str, bytes, dict[str, str]]  # subject, payload, headers


def _headers(kind: RecordKind, worker_id: str, rank: int, msg_id: str) -> dict[str, str]:
    return {H_ID: msg_id, H_KIND: kind, H_WORKER: quote(worker_id, safe=""), H_RANK: str(rank)}


def batch_record(prefix: str, worker_id: str, rank: int, seq: int, payload: bytes) -> Outgoing:
    digest = payload_digest(payload)
    headers = _headers("batch", worker_id, rank, f"{quote(worker_id)}/{rank}/{seq}/{digest}")
    headers[H_SEQ] = str(seq)
    headers[H_DIGEST] = digest
    return stream_subject(prefix, worker_id, rank), payload, headers


def reset_record(prefix: str, worker_id: str, rank: int, seq: int, digest: str) -> Outgoing:
    """The engine restarted; ``seq`` and ``digest`` name the new incarnation's first batch
    seen, so that every relay that saw the restart writes the same id."""
    msg_id = f"{quote(worker_id)}/{rank}/reset/{seq}/{digest}"
    headers = _headers("reset", worker_id, rank, msg_id)
    headers[H_SEQ] = str(seq)
    headers[H_DIGEST] = digest
    return stream_subject(prefix, worker_id, rank), b"", headers


def loss_record(prefix: str, worker_id: str, rank: int, start: int, end: int) -> Outgoing:
    msg_id = f"{quote(worker_id)}/{rank}/loss/{start}/{end}"
    headers = _headers("loss", worker_id, rank, msg_id)
    headers[H_SEQ] = str(start)
    headers[H_END] = str(end)
    return stream_subject(prefix, worker_id, rank), b"", headers


def live_record(prefix: str, worker_id: str, rank: int, last_seq: int) -> Outgoing:
    msg_id = f"{quote(worker_id)}/{rank}/live/{last_seq}"
    headers = _headers("live", worker_id, rank, msg_id)
    headers[H_SEQ] = str(last_seq)
    return stream_subject(prefix, worker_id, rank), b"", headers


def worker_record(prefix: str, reg: WorkerRegistration) -> Outgoing:
    body = json.dumps(
        {
            "worker_id": reg.worker_id,
            "endpoint": reg.endpoint,
            "block_size": reg.block_size,
            "ranks": list(reg.ranks),
            "model_name": reg.model_name,
        },
        sort_keys=True,
    ).encode()
    msg_id = f"{quote(reg.worker_id)}/worker/{payload_digest(body)}"
    headers = _headers("worker", reg.worker_id, 0, msg_id)
    return worker_subject(prefix, reg.worker_id), body, headers


def _int(headers: dict[str, str], name: str, default: int | None = None) -> int:
    raw = headers.get(name)
    if raw is None:
        if default is not None:
            return default
        raise RecordError("missing", field=name)
    try:
        value = int(raw)
    except ValueError:
        raise RecordError(f"not an integer: {raw[:40]!r}", field=name) from None
    if value < 0:
        raise RecordError(f"must be >= 0, got {value}", field=name)
    return value


def parse_record(headers: dict[str, str] | None, body: bytes) -> RelayRecord:
    """A message's record; RecordError naming the header at fault if it is not one."""
    if not headers:
        raise RecordError("the message has no headers", field="headers")
    kind = headers.get(H_KIND)
    if kind not in _KINDS:
        raise RecordError(f"unknown kind {str(kind)[:40]!r}", field=H_KIND)
    worker = headers.get(H_WORKER)
    if not worker:
        raise RecordError("missing", field=H_WORKER)
    worker_id = unquote(worker)
    rank = _int(headers, H_RANK)
    seq = _int(headers, H_SEQ, 0)
    end = _int(headers, H_END, 0)
    if kind == "loss" and end <= seq:
        raise RecordError(f"a loss must end after it starts ({seq}..{end})", field=H_END)
    digest = headers.get(H_DIGEST, "")
    if kind in ("batch", "reset") and not digest:
        raise RecordError("missing", field=H_DIGEST)
    return RelayRecord(kind, worker_id, rank, seq, end, digest, body)  # type: ignore[arg-type]


def _registration(body: bytes) -> WorkerRegistration:
    try:
        data = json.loads(body)
        ranks = tuple(sorted({int(r) for r in data["ranks"]}))
        block_size = int(data["block_size"])
        reg = WorkerRegistration(
            worker_id=str(data["worker_id"]),
            endpoint=str(data["endpoint"]),
            block_size=block_size,
            ranks=ranks,
            model_name=data.get("model_name"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"not a worker registration ({exc})", field="body") from None
    if block_size <= 0 or not ranks or min(ranks) < 0:
        raise RecordError("block_size must be > 0 and ranks >= 0", field="body")
    return reg
