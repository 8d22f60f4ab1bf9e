"""The conformance scenarios: one small deterministic fault script each, with its truth.

Every scenario runs after a handshake (a sentinel store shown on every stream) and ends with
another sentinel, so the consumer is judged on a settled state. Prompts are fresh token runs
(4 blocks of 16 tokens unless said); ``A[2-3]`` in a reason names blocks 2 and 3 of prompt A.
docs/conformance.md explains each choice of truth.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvevents.testing.conformance.stage import Prompt, Scenario, Stage, StreamDef

__all__ = ["array_payload", "bytes_hash_payload", "scenario", "scenario_names", "scenarios"]

W0 = StreamDef("w0")
W1 = StreamDef("w1")
K0, K1 = W0.key, W1.key


# ---------------------------------------------------------------------- payload encoders


def array_payload(events: Sequence[Event], rank: int | None = 0) -> bytes:
    """A batch whose events are tagged arrays, as vLLM 0.10-0.16 sent them."""
    return msgspec.msgpack.encode([time.time(), [_array_event(e) for e in events], rank])


def _array_event(event: Event) -> list[Any]:  # an event as a plain array: mixed values
    if isinstance(event, BlockStored):
        e = event
        return [
            "BlockStored",
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def _digests(prompt: Prompt) -> list[bytes]:
    """32-byte digests as vLLM sends them with integer hashes off: their last 8 bytes are the
    prompt's (vLLM-style) engine hashes, the bytes before them filler."""
    return [hashlib.sha256(b"%d" % h).digest()[:24] + h.to_bytes(8, "big") for h in prompt.hashes]


def bytes_hash_payload(
    prompt: Prompt, start: int, end: int, *, remove: Sequence[int] = (), rank: int = 0
) -> bytes:
    """vLLM with integer hashes off: stores blocks ``start:end`` (and removes blocks
    ``remove``) with 32-byte digests as hashes, in array-era events."""
    d, bs = _digests(prompt), prompt.block_size
    stored = [
        "BlockStored",
        d[start:end],
        d[start - 1] if start else None,
        list(prompt.tokens[start * bs : end * bs]),
        bs,
        None,
        "GPU",
        None,
    ]
    events: list[Any] = [stored]  # events as a peer sends them: structs and arrays mixed
    if remove:
        events.append(["BlockRemoved", [d[i] for i in remove], "GPU"])
    return msgspec.msgpack.encode([time.time(), events, rank])


# ---------------------------------------------------------------------- scripts


def _clean(stage: Stage) -> None:
    a, b, c = stage.prompt("A"), stage.prompt("B", 6), stage.prompt("C")
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, a.store(2))
    stage.publish(K1, b.store())
    stage.publish(K1, b.remove(4))
    stage.publish(K0, c.store(), a.remove(3))


def _drops(stage: Stage) -> None:
    a, b, c = stage.prompt("A"), stage.prompt("B"), stage.prompt("C")
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, a.store(2), drop=True)
    stage.publish(K0, b.store())
    stage.publish(K0, b.remove(2), drop=True)
    stage.publish(K0, c.store(), drop=True)
    stage.publish(K0, c.remove(3), drop=True)
    stage.publish(K0, a.remove(3))


def _duplicates(stage: Stage) -> None:
    a, b = stage.prompt("A"), stage.prompt("B")
    pub = stage.pubs[K0]
    first = stage.publish(K0, a.store())
    second = stage.publish(K0, a.remove(2))
    pub.duplicate(first)
    pub.duplicate(second)
    third = stage.publish(K0, b.store())
    pub.duplicate(third)
    pub.duplicate(first)
    stage.publish(K0, b.remove(3))


def _late_join_prelude(stage: Stage) -> None:
    a, b = stage.prompt("A"), stage.prompt("B")
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, a.store(2))
    stage.publish(K0, b.store())
    stage.publish(K0, b.remove(1))
    stage.publish(K0, a.remove(3))


def _late_join(stage: Stage) -> None:
    stage.publish(K0, stage.prompt("C").store())


def _restart(stage: Stage) -> None:
    a, b, d = stage.prompt("A"), stage.prompt("B"), stage.prompt("D")
    stage.publish(K0, a.store())
    stage.publish(K1, d.store())
    # The old incarnation runs well past what the new one will reach before the check.
    for _ in range(40):
        stage.heartbeat(K0)
    stage.restart(K0)
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, b.store())


def _three_frame_prelude(stage: Stage) -> None:
    stage.pubs[K0].behaviour.reply_frames = 3
    stage.publish(K0, stage.prompt("A").store())


def _three_frame(stage: Stage) -> None:
    b, c = stage.prompt("B"), stage.prompt("C")
    stage.publish(K0, b.store(), drop=True)
    stage.publish(K0, b.remove(3), drop=True)
    stage.publish(K0, c.store())


def _ring_trimmed(stage: Stage) -> None:
    a, b, c, d = (stage.prompt(n) for n in "ABCD")
    stage.publish(K1, d.store())
    stage.publish(K0, a.store())
    # B is lost for good: a consumer cannot know it, so the truth leaves it out.
    stage.publish(K0, b.store(), drop=True, known=False)
    stage.publish(K0, b.remove(3), drop=True, known=False)
    stage.pubs[K0].forget_before(stage.pubs[K0].next_seq)
    stage.publish(K0, c.store())
    stage.truth.lossy.add(K0)


def _encoding_switch(stage: Stage) -> None:
    a, c, b = stage.prompt("A"), stage.prompt("C", style="sglang"), stage.prompt("B")
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, a.store(2))
    first: list[Event] = [c.store(0, 2)]
    rest: list[Event] = [c.store(2), c.remove(3)]
    stage.publish_payload(K0, array_payload(first), first)
    stage.publish_payload(K0, array_payload(rest), rest)
    stage.publish_payload(K0, bytes_hash_payload(b, 0, 2), [b.store(0, 2)])
    stage.publish_payload(K0, bytes_hash_payload(b, 2, 4, remove=[3]), [b.store(2), b.remove(3)])


def _unknown_tag(stage: Stage) -> None:
    a = stage.prompt("A")
    events = [
        msgspec.to_builtins(a.store(0, 2)),
        {"type": "BlockPinned", "block_hashes": [1, 2], "medium": "GPU"},
        msgspec.to_builtins(a.store(2)),
    ]
    payload = msgspec.msgpack.encode([time.time(), events, 0])
    stage.publish_payload(K0, payload, [a.store(0, 2), a.store(2)])


def _reordered_parent(stage: Stage) -> None:
    p, q = stage.prompt("P"), stage.prompt("Q")
    stage.publish(K0, p.store(2))  # the engine sent the child first
    stage.publish(K0, p.store(0, 2))
    stage.publish(K0, q.store(0, 2), drop=True)  # the parent is lost live, then replayed
    stage.publish(K0, q.store(2))


def _block_size(stage: Stage) -> None:
    a, wide = stage.prompt("A"), stage.prompt("W", 2, block_size=32)
    stage.publish(K0, a.store(0, 2))
    stage.publish(K0, wide.store(), known=False)
    stage.publish(K0, a.store(2))
    stage.truth.rejecting.add(K0)


def _all_cleared(stage: Stage) -> None:
    a, b, c = stage.prompt("A"), stage.prompt("B"), stage.prompt("C")
    stage.publish(K0, a.store())
    stage.publish(K1, b.store())
    stage.publish(K0, AllBlocksCleared())
    stage.publish(K0, c.store(0, 2))


def _unknown_removals(stage: Stage) -> None:
    a, ghost = stage.prompt("A"), stage.prompt("G", probe=False)
    stage.publish(K0, BlockRemoved(block_hashes=[12345, -7, 2**64 - 1]), a.store())
    stage.publish(K0, a.remove(3))
    stage.publish(K0, a.remove(3), ghost.remove())


_RANKS = tuple(StreamDef("w0", r) for r in range(4))


def _many_ranks(stage: Stage) -> None:
    own = [stage.prompt(f"R{r}") for r in range(4)]
    shared = stage.prompt("S")
    for s, prompt in zip(_RANKS, own, strict=True):
        stage.publish(s.key, prompt.store())
    stage.publish(("w0", 1), shared.store())
    stage.publish(("w0", 2), shared.store())
    stage.publish(("w0", 3), own[3].remove(2))
    stage.publish(("w0", 2), shared.remove(3))


# ---------------------------------------------------------------------- the catalogue


def scenarios() -> list[Scenario]:
    """Every scenario, in the order reports list them."""
    return [
        Scenario(
            "clean",
            "stores and removals on two workers, nothing lost",
            "exactly what was stored and not removed",
            (W0, W1),
            _clean,
        ),
        Scenario(
            "drops",
            "4 of 7 live batches lost (a child, a removal, two in a row); all in the replay ring",
            "the full state, recovered by replay",
            (W0,),
            _drops,
        ),
        Scenario(
            "duplicates",
            "batches sent live again after later ones (a store after its removal, a store twice)",
            "each batch applied once: no resurrected or doubly held blocks",
            (W0,),
            _duplicates,
        ),
        Scenario(
            "late-join",
            "5 batches published before the consumer registers",
            "everything from seq 0, by replay",
            (W0,),
            _late_join,
            _late_join_prelude,
        ),
        Scenario(
            "restart",
            "w0's publisher restarts after 42 batches: seq back to 0, empty "
            "ring, 2 old blocks announced again, a new prompt",
            "w0 holds only the new incarnation's blocks; w1 untouched",
            (W0, W1),
            _restart,
        ),
        Scenario(
            "replay-3-frame",
            "replays answered in 3 frames [b'', seq, payload] (late join and a gap)",
            "the full state",
            (W0,),
            _three_frame,
            _three_frame_prelude,
        ),
        Scenario(
            "ring-trimmed",
            "2 batches lost live and trimmed from the replay ring",
            "what the surviving batches say, and the loss reported on w0 only",
            (W0, W1),
            _ring_trimmed,
        ),
        Scenario(
            "encoding-switch",
            "map events, then array-era events with signed hashes, "
            "then 32-byte bytes hashes, on one stream",
            "every block, whatever its encoding (bytes hashes read as their last 8 bytes)",
            (W0,),
            _encoding_switch,
        ),
        Scenario(
            "unknown-tag",
            "an unknown event tag between two good stores in one batch",
            "both good stores applied",
            (W0,),
            _unknown_tag,
        ),
        Scenario(
            "reordered-parent",
            "a child store sent before its parent; another "
            "parent lost live and replayed after its child",
            "both prompts whole, at their true positions",
            (W0,),
            _reordered_parent,
        ),
        Scenario(
            "block-size-mismatch",
            "a store of 32-token blocks on a stream registered with 16",
            "the store rejected, the rest applied, and the rejection exposed",
            (W0,),
            _block_size,
        ),
        Scenario(
            "all-cleared",
            "AllBlocksCleared on w0, then a new store",
            "w0 holds only what came after the clear; w1 untouched",
            (W0, W1),
            _all_cleared,
        ),
        Scenario(
            "unknown-removals",
            "removals of never-stored hashes (signed, u64 max) and a block removed twice",
            "nothing else changes",
            (W0,),
            _unknown_removals,
        ),
        Scenario(
            "many-ranks",
            "4 ranks of one worker, a prompt on two ranks, removals on two",
            "each rank holds its own blocks",
            _RANKS,
            _many_ranks,
        ),
    ]


def scenario_names() -> list[str]:
    return [s.name for s in scenarios()]


def scenario(name: str) -> Scenario:
    """One scenario by name; ``KeyError`` listing the names otherwise."""
    for s in scenarios():
        if s.name == name:
            return s
    raise KeyError(f"unknown scenario {name!r}; known: {', '.join(scenario_names())}")
