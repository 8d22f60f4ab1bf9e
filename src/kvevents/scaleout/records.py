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

A record is validated whole when it is parsed (:func:`parse_record`): header numbers within
their ranges, the digest's form, a ``worker`` body within the bounds of ``POST /register``
and its endpoints usable, so that what a replica applies its snapshot can always hold. The
relay builds a ``worker`` record through the same check (:func:`check_registration`), so it
never writes one a replica would refuse.

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
from typing import Annotated, Literal, TypeAlias, cast
from urllib.parse import quote, unquote

import msgspec

from kvevents.errors import LayoutError
from kvevents.service.bounds import MAX_RANK, MAX_RANKS, BlockSize, EndpointText, Name, Rank, Text
from kvevents.service.feed import WorkerRegistration, default_stream_specs

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_STREAM",
    "RecordError",
    "RecordKind",
    "RelayRecord",
    "batch_record",
    "check_registration",
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
_DIGEST = re.compile(r"[0-9a-f]{16}")

#: The largest sequence number: engines number batches with a uint64.
MAX_SEQ = (1 << 64) - 1
#: The largest ``worker`` body: a registration of 1,024 ranks is about 7 KB of JSON.
MAX_WORKER_BODY = 64 * 1024
#: The longest worker id (as over HTTP and in the state file).
MAX_WORKER_ID = 256
# Header numbers are decimal: longer text is refused before int() reads it.
_MAX_DIGITS = 20


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
    ``batch``, the registration JSON of a ``worker``, empty otherwise); ``worker`` is the
    registration a ``worker`` record carries, checked."""

    kind: RecordKind
    worker_id: str
    rank: int
    seq: int = 0
    end: int = 0
    digest: str = ""
    body: bytes = b""
    worker: WorkerRegistration | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker_id, self.rank)

    def registration(self) -> WorkerRegistration:
        """The registration a ``worker`` record carries; RecordError if it is not one."""
        if self.worker is None:
            raise RecordError(f"a {self.kind} record carries no registration", field=H_KIND)
        return self.worker


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
    """The record of ``reg``; RecordError (naming the field) if a replica would refuse it."""
    body = _worker_body(reg)
    _registration(body)
    msg_id = f"{quote(reg.worker_id)}/worker/{payload_digest(body)}"
    headers = _headers("worker", reg.worker_id, 0, msg_id)
    return worker_subject(prefix, reg.worker_id), body, headers


def check_registration(reg: WorkerRegistration) -> WorkerRegistration:
    """``reg`` as a replica reads it back from its ``worker`` record (the fields the record
    carries); RecordError naming the field and the rule if a replica would refuse it."""
    return _registration(_worker_body(reg))


def _worker_body(reg: WorkerRegistration) -> bytes:
    fields = {
        "worker_id": reg.worker_id,
        "endpoint": reg.endpoint,
        "block_size": reg.block_size,
        "ranks": list(reg.ranks),
        "model_name": reg.model_name,
    }
    if reg.report_mode != "incremental":  # the field came later: an older replica ignores it
        fields["report_mode"] = reg.report_mode
    return json.dumps(fields, sort_keys=True).encode()


def _int(headers: dict[str, str], name: str, top: int, default: int | None = None) -> int:
    raw = headers.get(name)
    if raw is None:
        if default is not None:
            return default
        raise RecordError("missing", field=name)
    if len(raw) > _MAX_DIGITS:
        raise RecordError(
            f"not an integer of at most {_MAX_DIGITS} digits: {raw[:40]!r}", field=name
        )
    if not (raw.isascii() and raw.isdigit()):  # as a relay writes it: no sign, no spaces
        raise RecordError(f"not a decimal integer: {raw[:40]!r}", field=name)
    value = int(raw)
    if value > top:
        raise RecordError(f"must be <= {top}, got {value}", field=name)
    return value


def parse_record(headers: dict[str, str] | None, body: bytes) -> RelayRecord:
    """A message's record, checked whole; RecordError naming the header (or the body) at
    fault if it is not one."""
    if not headers:
        raise RecordError("the message has no headers", field="headers")
    kind = headers.get(H_KIND)
    if kind not in _KINDS:
        raise RecordError(f"unknown kind {str(kind)[:40]!r}", field=H_KIND)
    worker_id = _worker_id(headers)
    rank = _int(headers, H_RANK, MAX_RANK)
    seq = _int(headers, H_SEQ, MAX_SEQ, 0)
    end = _int(headers, H_END, MAX_SEQ + 1, 0)
    if kind == "loss" and end <= seq:
        raise RecordError(f"a loss must end after it starts ({seq}..{end})", field=H_END)
    digest = headers.get(H_DIGEST, "")
    if kind in ("batch", "reset") and not _DIGEST.fullmatch(digest):
        raise RecordError(f"not 16 hex digits: {digest[:40]!r}", field=H_DIGEST)
    worker = _registration(body) if kind == "worker" else None
    if worker is not None and worker.worker_id != worker_id:
        message = f"names worker {worker.worker_id[:40]!r}, not {worker_id[:40]!r}"
        raise RecordError(message, field="body")
    return RelayRecord(cast(RecordKind, kind), worker_id, rank, seq, end, digest, body, worker)


def _worker_id(headers: dict[str, str]) -> str:
    worker = headers.get(H_WORKER)
    if not worker:
        raise RecordError("missing", field=H_WORKER)
    if len(worker) > 3 * 4 * MAX_WORKER_ID:  # percent-encoded UTF-8: at most 12 per character
        raise RecordError(f"{len(worker)} characters, too long", field=H_WORKER)
    worker_id = unquote(worker)
    if len(worker_id) > MAX_WORKER_ID:
        raise RecordError(f"{len(worker_id)} characters; at most {MAX_WORKER_ID}", field=H_WORKER)
    return worker_id


class _WorkerBody(msgspec.Struct, kw_only=True):
    """A ``worker`` record's body, with the bounds of ``POST /register`` and the state file
    (unknown fields are ignored: a newer relay may write more)."""

    worker_id: Name
    endpoint: EndpointText
    block_size: BlockSize
    ranks: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]
    model_name: Text | None = None
    report_mode: Literal["incremental", "full"] = "incremental"


_worker_decoder = msgspec.json.Decoder(_WorkerBody)


def _registration(body: bytes) -> WorkerRegistration:
    """The registration in a ``worker`` body; RecordError naming the field and the rule."""
    if len(body) > MAX_WORKER_BODY:
        message = f"{len(body)} bytes; a registration has at most {MAX_WORKER_BODY}"
        raise RecordError(message, field="body")
    try:
        data = _worker_decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is one: it names the field
        raise RecordError(f"not a worker registration ({exc})", field="body") from None
    except RecursionError:
        raise RecordError(
            "not a worker registration (JSON nested too deeply)", field="body"
        ) from None
    reg = WorkerRegistration(
        worker_id=data.worker_id,
        endpoint=data.endpoint,
        block_size=data.block_size,
        ranks=tuple(sorted(set(data.ranks))),
        model_name=data.model_name,
        report_mode=data.report_mode,
    )
    try:
        default_stream_specs(reg)  # every rank's endpoint, as the replica names its streams
    except LayoutError as exc:
        raise RecordError(f"endpoint {exc.endpoint!r} ({exc.rule}): {exc}", field="body") from None
    return reg
