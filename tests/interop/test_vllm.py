"""A real vLLM engine (CPU build) publishes KV events; our index predicts its prefix-cache hits.

One engine per module (``vllm_peer.VllmEngine``: a tiny random-weight Llama, block size 32,
a 16-block cache so blocks get evicted) publishes through vLLM's own ZeroMQ publisher with
replay. Two consumers follow it: our ``Subscriber`` + ``PrefixIndex`` in this process, and
``kvevents serve`` in its own (``/register`` + ``/query``). Before each request both wait until
they applied every batch the engine published so far (sequence numbers, bounded), predict the
hit (matched blocks x block size, capped as vLLM caps it), then the engine runs the request and
reports ``num_cached_tokens``: the ground truth.

Skipped with the reason where ``.venv-vllm`` has no working vLLM (``make vllm`` installs it),
failed instead when ``KVEVENTS_REQUIRE_VLLM`` is set. ``KVEVENTS_VLLM_REPORT=path`` writes every
compared request and the timings as JSON (the figures in docs/interop.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from vllm_peer import (
    Follower,
    Harness,
    IndexFollower,
    ServiceFollower,
    VllmEngine,
    scratch_dir,
    tokens,
    vllm_version,
)

from kvevents.events import AllBlocksCleared, BlockStored

pytestmark = [pytest.mark.interop, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
NUM_BLOCKS = 16  # 15 usable: vLLM keeps one as its null block


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def harness(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    engine = VllmEngine(
        vllm_python, scratch_dir("kvv-"), tmp_path_factory.mktemp("model"), BLOCK, NUM_BLOCKS
    )
    followers: list[Follower] = []
    try:
        engine.start()
        followers += [IndexFollower(engine), ServiceFollower(engine)]
        running = Harness(engine, followers)
        running.prime(followers, random.Random("prime"))
        yield running
        _report(running)
    finally:
        for follower in followers:
            follower.close()
        engine.stop()
        shutil.rmtree(engine.directory, ignore_errors=True)


@pytest.fixture
def h(harness: Harness, request: pytest.FixtureRequest) -> Harness:
    harness.test = request.node.name
    return harness


def _report(harness: Harness) -> None:
    path = os.environ.get("KVEVENTS_VLLM_REPORT")
    if not path:
        return
    report = {
        "vllm": vllm_version()[0],
        "startup_seconds": harness.engine.startups,
        "rows": [asdict(r) for r in harness.rows],
    }
    Path(path).write_text(json.dumps(report, indent=1))


def _index(harness: Harness) -> IndexFollower:
    (index,) = [f for f in harness.followers if isinstance(f, IndexFollower)]
    return index


# --------------------------------------------------------------------------- tests


def test_vllm_stores_full_blocks_with_their_tokens(h: Harness) -> None:
    """vLLM's BlockStored reach our subscriber decoded: full 32-token blocks, chained by parent."""
    rng = random.Random("shape")
    prompt = tokens(rng, 3 * BLOCK + 5)
    h.request(prompt)
    h.sync()
    stores = [e for b in _index(h).payloads for e in b.events if isinstance(e, BlockStored)]
    mine = [e for e in stores if e.token_ids[:BLOCK] == prompt[:BLOCK]]
    assert len(mine) == 1, stores
    (event,) = mine
    assert event.block_size == BLOCK
    assert event.token_ids == prompt[: 3 * BLOCK]  # the 5-token tail is never stored
    assert len(event.block_hashes) == 3
    assert event.parent_block_hash is None


def test_shared_prefixes_are_predicted_exactly(h: Harness) -> None:
    """A shared system prompt and a growing conversation: every predicted hit is vLLM's."""
    rng = random.Random("shared")
    system = tokens(rng, 3 * BLOCK)
    turn = system + tokens(rng, 40)
    prompts = [system + tokens(rng, 40) for _ in range(3)]
    prompts += [turn, turn + tokens(rng, 50), system + tokens(rng, 7)]
    rows = [h.request(p) for p in prompts]
    assert h.disagreements(rows) == []
    assert [r.actual for r in rows] == [0, 96, 96, 96, 128, 96]


def test_evictions_are_followed(h: Harness) -> None:
    """More distinct blocks than the cache holds: evicted prefixes are predicted as misses."""
    rng = random.Random("evict")
    prompts = [tokens(rng, 4 * BLOCK + 7) for _ in range(6)]
    index = _index(h).index
    removed_before = index.stats().removed_blocks
    order = [0, 1, 2, 0, 3, 4, 0, 1, 5, 2, 3, 0]
    rows = [h.request(prompts[i]) for i in order]
    h.sync()
    assert h.disagreements(rows) == []
    assert index.stats().removed_blocks > removed_before
    assert {r.actual for r in rows} >= {0, 4 * BLOCK}, "the workload had both hits and misses"
    returns = [r for k, r in enumerate(rows) if order[k] in order[:k]]
    assert any(r.actual == 0 for r in returns), "some prompt was evicted before it came back"


def test_a_whole_prompt_hit_leaves_the_last_token_to_compute(h: Harness) -> None:
    """vLLM caps a hit at (len - 1) // block_size blocks: the index matches all, vLLM serves one less."""
    rng = random.Random("exact")
    prompt = tokens(rng, 3 * BLOCK)
    h.request(prompt)
    h.sync()
    assert _index(h).matched_blocks(prompt) == 3
    row = h.request(prompt)
    assert row.actual == 2 * BLOCK
    assert h.disagreements([row]) == []


def test_same_cache_salt_hits(h: Harness) -> None:
    """A prompt repeated under the same cache_salt hits, and the index predicts it."""
    rng = random.Random("salt-same")
    prompt = tokens(rng, 2 * BLOCK + 3)
    rows = [h.request(prompt, salt="tenant-a") for _ in range(2)]
    assert [r.actual for r in rows] == [0, 2 * BLOCK]
    assert h.disagreements(rows) == []


def test_other_cache_salt_misses(h: Harness) -> None:
    """A prompt cached under one cache_salt is a miss under another salt or none."""
    rng = random.Random("salt-other")
    prompt = tokens(rng, 2 * BLOCK + 3)
    h.request(prompt, salt="tenant-a")
    rows = [h.request(prompt, salt="tenant-b"), h.request([*prompt, 5], salt=None)]
    assert [r.actual for r in rows] == [0, 0]
    assert h.disagreements(rows) == []


def test_late_subscriber_recovers_through_vllm_replay(h: Harness) -> None:
    """A subscriber and a service started after many batches rebuild the index from vLLM's replay."""
    rng = random.Random("late")
    late = IndexFollower(h.engine, name="late-index")
    late_service = ServiceFollower(h.engine, name="late-service")
    try:
        h.prime([late, late_service], rng)
        assert late.stream().replayed > 0
        assert late_service.stream()["replayed"] > 0
        h.sync()
        assert late.index.snapshot() == _index(h).index.snapshot()
        h.followers += [late, late_service]
        prompt = tokens(rng, 2 * BLOCK + 1)
        rows = [h.request(prompt), h.request(prompt + tokens(rng, 40))]
        assert h.disagreements(rows) == []
        assert rows[1].actual == 2 * BLOCK
    finally:
        for follower in (late, late_service):
            if follower in h.followers:
                h.followers.remove(follower)
            follower.close()


def test_engine_restart_empties_the_prediction(h: Harness) -> None:
    """A restarted engine (sequence back to 0, empty cache): nothing of the old one is predicted."""
    rng = random.Random("restart")
    prompt = tokens(rng, 3 * BLOCK + 2)
    assert h.request(prompt).actual == 0
    h.engine.stop()
    h.engine.start()
    h.restarts += 1
    h.published = 0
    h.prime(h.followers, rng)
    assert _index(h).resets == 1
    rows = [h.request(prompt), h.request(prompt)]
    assert [r.actual for r in rows] == [0, 3 * BLOCK]
    assert h.disagreements(rows) == []


def test_reset_prefix_cache_is_published_only_with_the_next_step(h: Harness) -> None:
    """vLLM publishes nothing at a reset: AllBlocksCleared heads the batch of the next step."""
    rng = random.Random("reset-late")
    prompt = tokens(rng, 2 * BLOCK + 1)
    h.request(prompt)
    before = h.published
    reply = h.engine.call({"op": "reset"})
    assert reply["reset"] is True
    assert reply["published"] == before, "nothing is published by the reset itself"
    # Not a compared row: this step schedules against the emptied cache before it publishes
    # the clear, so no consumer of the stream alone could have predicted it.
    cached, h.published = h.engine.generate(prompt)
    assert cached == 0
    h.sync()
    (batch,) = _index(h).payloads[-1:]
    assert isinstance(batch.events[0], AllBlocksCleared)
    assert any(isinstance(e, BlockStored) for e in batch.events[1:]), "same batch as the step"


def test_reset_prefix_cache_then_a_flush_step_is_predicted_exactly(h: Harness) -> None:
    """Reset, a one-token flush step, a handshake on the clear: the next requests are exact."""
    rng = random.Random("reset")
    prompt = tokens(rng, 2 * BLOCK + 1)
    h.request(prompt)
    h.sync()
    assert all(f.matched_blocks(prompt) == 2 for f in h.followers)
    assert h.reset_prefix_cache() is True
    (batch,) = _index(h).payloads[-1:]
    assert [type(e) for e in batch.events] == [AllBlocksCleared], "the flush stores no block"
    assert all(f.matched_blocks(prompt) == 0 for f in h.followers)
    rows = [h.request(prompt), h.request(prompt)]
    assert [r.actual for r in rows] == [0, 2 * BLOCK]
    assert h.disagreements(rows) == []
