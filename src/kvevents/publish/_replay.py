"""The replay side of a publisher (WIRE.md section 3): a bounded ring and a ROUTER server.

:class:`ReplayRing` is pure: the encoded batches a rank published, bounded by a batch count
(``buffer_steps``) and a byte budget, searchable by sequence number.

:class:`ReplayServer` answers DEALER requests on a ROUTER socket owned by the publisher's
service thread. Replies are sent non-blocking with ``ROUTER_MANDATORY`` and resumed later when a
client's pipe is full, a few messages per client per round, so one large or slow replay never
starves another client, the live path, or the capture draining. Hostile clients are bounded:
a peer (remote address) gets a token bucket of requests and a share of the reply slots, a reply
that makes no progress for ``send_timeout`` seconds gives its slot back, and requests are read
a bounded number at a time so the ring keeps filling during a flood. Nothing is dropped
silently: every refusal, timeout and vanished client has a counter.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvevents.errors import DecodeError
from kvevents.publish._admission import PeerBuckets
from kvevents.wire import parse_replay_request, replay_end_frames

__all__ = [
    "ReplayCounters",
    "ReplayLimits",
    "ReplayRing",
    "ReplayServer",
    "RingEntry",
    "SendResult",
]

_END = replay_end_frames()
# Messages sent to one client before moving to the next: small enough that a 10,000-batch
# replay yields to others (and to capture draining) every few hundred microseconds.
_CHUNK = 32
# Requests read per call of accept_requests(): the service thread goes back to draining the
# capture pipe (the ring) between two such bites of a flood.
_ACCEPT_LIMIT = 256


@dataclass(frozen=True)
class RingEntry:
    """One buffered batch: its sequence number, its 8-byte sequence frame and its payload."""

    seq: int
    seq_frame: bytes
    payload: bytes


class ReplayRing:
    """The last ``max_batches`` published batches, at most ``max_bytes`` of payload in all.

    Sequence numbers ascend but need not be dense: batches lost before they were sent (queue
    full, encode error) are never buffered. A batch larger than the whole budget is not kept.
    """

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("a replay ring needs max_batches >= 1 and max_bytes >= 1")
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._entries: list[RingEntry] = []
        self._head = 0
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries) - self._head

    @property
    def nbytes(self) -> int:
        """Payload bytes currently held."""
        return self._bytes

    @property
    def oldest_seq(self) -> int | None:
        """The sequence number of the oldest buffered batch, None when empty."""
        return self._entries[self._head].seq if len(self) else None

    def append(self, seq: int, seq_frame: bytes, payload: bytes) -> None:
        """Buffer a published batch, evicting the oldest ones beyond either bound."""
        if self._entries and seq <= self._entries[-1].seq:
            raise ValueError(f"seq {seq} does not follow {self._entries[-1].seq}")
        self._entries.append(RingEntry(seq, seq_frame, payload))
        self._bytes += len(payload)
        while len(self) > self.max_batches or (self._bytes > self.max_bytes and len(self)):
            self._bytes -= len(self._entries[self._head].payload)
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._entries):
            # Compact now and then: amortised O(1) eviction with O(1) indexing.
            del self._entries[: self._head]
            self._head = 0

    def tail(self, start_seq: int) -> list[RingEntry]:
        """A snapshot of every buffered batch with ``seq >= start_seq``, oldest first."""
        lo = bisect.bisect_left(self._entries, start_seq, lo=self._head, key=_seq_of)
        return self._entries[lo:]


def _seq_of(entry: RingEntry) -> int:
    return entry.seq


class SendResult(enum.Enum):
    """What a non-blocking send to one replay client did."""

    SENT = "sent"
    BLOCKED = "blocked"  # the client's pipe is full: try again later
    LOST = "lost"  # the client is gone


@dataclass
class _Session:
    identity: bytes
    peer: str
    start_seq: int
    entries: list[RingEntry] = field(default_factory=list)
    position: int = 0
    ends: int = 1  # end markers owed after the entries: answers to requests queued behind it
    last_progress: float = 0.0


@dataclass
class ReplayCounters:
    """What the server did; read by ``Publisher.stats()`` (single writer: the service thread)."""

    requests: int = 0
    batches_served: int = 0
    rejected: int = 0
    malformed: int = 0
    rate_limited: int = 0
    timed_out: int = 0
    clients_lost: int = 0


@dataclass(frozen=True)
class ReplayLimits:
    """The bounds of a replay server (``PublisherOptions`` documents each)."""

    max_active: int = 8
    max_waiting: int = 64
    per_peer: int = 2
    send_timeout: float = 5.0
    rate: float = 10.0
    burst: int = 20

    @property
    def per_peer_waiting(self) -> int:
        """Requests one peer may have waiting: an eighth of the queue, so it cannot fill it alone."""
        return max(1, self.max_waiting // 8)


class ReplayServer:
    """Serves replay requests on a bound ROUTER socket; used only by the thread that owns it.

    ``before_snapshot`` is called before a reply's snapshot is taken: the publisher drains its
    capture pipe there, so a reply holds every batch a subscriber may already have seen live.
    """

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        ring: ReplayRing,
        topic: bytes,
        limits: ReplayLimits,
        *,
        before_snapshot: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._ring = ring
        self._topic = topic
        self.limits = limits
        self._before_snapshot = before_snapshot
        self._clock = clock
        self._buckets = PeerBuckets(limits.rate, limits.burst)
        self._active: list[_Session] = []
        self._waiting: dict[str, deque[_Session]] = {}  # per peer, oldest request first
        self._waiting_count = 0
        self._active_per_peer: dict[str, int] = {}
        # When each peer with active or waiting requests last got a slot (a tick, not a time).
        self._started_at: dict[str, int] = {}
        self._starts = 0
        self._last: dict[bytes, _Session] = {}  # each client's newest session not yet finished
        self.counters = ReplayCounters()

    @property
    def busy(self) -> bool:
        """True while some reply is still being sent."""
        return bool(self._active)

    @property
    def active(self) -> int:
        """Replies in progress."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests waiting for a reply slot."""
        return self._waiting_count

    @property
    def peers_tracked(self) -> int:
        """Peers with a token bucket (bounded)."""
        return len(self._buckets)

    def accept_requests(self) -> bool:
        """Read pending requests (non-blocking, a bounded number); True if some may remain."""
        for _ in range(_ACCEPT_LIMIT):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._activate()
                return False
            self.counters.requests += 1
            self._admit(frames)
        self._activate()
        return True

    def _admit(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        peer = _peer_of(frames)
        try:
            start = parse_replay_request([f.bytes for f in frames[1:]])
        except DecodeError:
            self.counters.malformed += 1
            self._answer_end(identity)
            return
        if not self._buckets.allow(peer, self._clock()):
            self.counters.rate_limited += 1
            self._answer_end(identity)
            return
        queue = self._waiting.get(peer)
        waiting_here = len(queue) if queue is not None else 0
        if (
            self._waiting_count >= self.limits.max_waiting
            or waiting_here >= self.limits.per_peer_waiting
        ):
            # Beyond the wait queue the client gets the end marker at once (never silence);
            # its first replayed sequence then differs from what it asked: a visible gap.
            self.counters.rejected += 1
            self._answer_end(identity)
            return
        session = _Session(identity=identity, peer=peer, start_seq=start)
        self._waiting.setdefault(peer, deque()).append(session)
        self._waiting_count += 1
        self._last[identity] = session

    def _answer_end(self, identity: bytes) -> None:
        pending = self._last.get(identity)
        if pending is not None:
            # The client is still owed a reply: its answers keep the order of its requests.
            pending.ends += 1
            return
        if self._try_send([identity, *_END]) is SendResult.BLOCKED:
            self.counters.clients_lost += 1

    def _activate(self) -> None:
        busy = {s.identity for s in self._active}
        while self._waiting and len(self._active) < self.limits.max_active:
            picked = self._pick(busy)
            if picked is None:
                return
            peer, index = picked
            queue = self._waiting[peer]
            session = queue[index]
            del queue[index]
            if not queue:
                del self._waiting[peer]
            self._waiting_count -= 1
            self._start(session)
            busy.add(session.identity)

    def _pick(self, busy: set[bytes]) -> tuple[str, int] | None:
        """The waiting request to start: from the peer holding the fewest slots, and among
        those the one served least recently (round-robin); None when no peer may start one."""
        best: tuple[tuple[int, int], str, int] | None = None
        for peer, queue in self._waiting.items():
            held = self._active_per_peer.get(peer, 0)
            if held >= self.limits.per_peer:
                continue
            # One reply at a time per client, in request order; other clients of a peer may go.
            index = next((i for i, s in enumerate(queue) if s.identity not in busy), None)
            rank = (held, self._started_at.get(peer, -1))
            if index is not None and (best is None or rank < best[0]):
                best = (rank, peer, index)
        return None if best is None else (best[1], best[2])

    def _start(self, session: _Session) -> None:
        self._before_snapshot()
        session.entries = self._ring.tail(session.start_seq)
        session.last_progress = self._clock()
        self._active.append(session)
        self._active_per_peer[session.peer] = self._active_per_peer.get(session.peer, 0) + 1
        self._starts += 1
        self._started_at[session.peer] = self._starts

    def pump(self) -> bool:
        """Send one round (a few messages per reply); True if any message went out."""
        progressed = False
        now = self._clock()
        for session in list(self._active):
            sent, done = self._send_chunk(session)
            if sent:
                progressed = True
                session.last_progress = now
            elif not done and now - session.last_progress >= self.limits.send_timeout:
                # A client that reads nothing gives its slot back; what it was owed is lost.
                self.counters.timed_out += 1
                done = True
            if done:
                self._finish(session)
        if len(self._active) > 1:
            self._active.append(self._active.pop(0))  # round-robin: who goes first rotates
        if progressed or not self._active:
            self._activate()
        return progressed

    def _finish(self, session: _Session) -> None:
        self._active.remove(session)
        left = self._active_per_peer[session.peer] - 1
        if left:
            self._active_per_peer[session.peer] = left
        else:
            del self._active_per_peer[session.peer]
            if session.peer not in self._waiting:
                del self._started_at[session.peer]
        if self._last.get(session.identity) is session:
            del self._last[session.identity]

    def _send_chunk(self, session: _Session) -> tuple[int, bool]:
        sent = 0
        entries = session.entries
        while sent < _CHUNK:
            if session.position < len(entries):
                entry = entries[session.position]
                frames = [session.identity, b"", self._topic, entry.seq_frame, entry.payload]
            else:
                frames = [session.identity, *_END]
            outcome = self._try_send(frames)
            if outcome is SendResult.BLOCKED:
                return sent, False
            if outcome is SendResult.LOST:
                return sent, True
            sent += 1
            if session.position < len(entries):
                self.counters.batches_served += 1
            elif session.position + 1 >= len(entries) + session.ends:
                return sent, True
            session.position += 1
        return sent, False

    def _try_send(self, frames: list[bytes]) -> SendResult:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return SendResult.BLOCKED
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters.clients_lost += 1
            return SendResult.LOST
        return SendResult.SENT


def _peer_of(frames: list[zmq.Frame]) -> str:
    # The remote address libzmq recorded for the connection; empty where it has none (inproc).
    try:
        return str(frames[-1].get("Peer-Address") or "")
    except zmq.ZMQError:
        return ""
