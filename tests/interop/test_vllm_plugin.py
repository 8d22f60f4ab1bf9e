"""The vLLM plugin (kvevents.integrations.vllm): a real vLLM publishes through our publisher.

``make vllm`` installs kvevents into ``.venv-vllm``, so vLLM finds the ``vllm.general_plugins``
entry point. vLLM 0.32 accepts only ``"null"`` or ``"zmq"`` as ``publisher`` in its config, so
the engine runs with ``KVEVENTS_VLLM_OVERRIDE_ZMQ=1`` and the plugin takes the ``"zmq"`` name.
Our ``Subscriber`` + ``PrefixIndex`` and ``kvevents serve`` follow it exactly as they follow
vLLM's own publisher in test_vllm.py, and predict its hits.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm_peer import Harness, IndexFollower, ServiceFollower, VllmEngine, scratch_dir, tokens

import kvevents
from kvevents.deadline import Deadline
from kvevents.events import KVEventBatch
from kvevents.integrations.vllm import OVERRIDE_ENV, VllmPublisher
from kvevents.subscribe import Delivery, StreamSpec, Subscriber
from kvevents.testing.fixtures import wire_fixtures

pytestmark = [pytest.mark.interop, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
_PROBE = (
    "from importlib.metadata import entry_points; "
    "print(sorted(e.value for e in entry_points(group='vllm.general_plugins')))"
)


@pytest.fixture(scope="module")
def plugin_python(vllm_python: str) -> str:
    """vLLM's interpreter, once it lists our entry point (``make vllm`` installs it)."""
    done = subprocess.run(
        [vllm_python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    if "kvevents.integrations.vllm:register" not in done.stdout:
        pytest.fail(f"kvevents is not installed in vLLM's venv (make vllm): {done.stdout}")
    return vllm_python


@pytest.fixture(scope="module")
def harness(plugin_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    engine = VllmEngine(
        plugin_python,
        scratch_dir("kvp-"),
        tmp_path_factory.mktemp("model"),
        extra_env={OVERRIDE_ENV: "1"},
    )
    followers: list[IndexFollower | ServiceFollower] = []
    try:
        engine.start()
        followers += [IndexFollower(engine), ServiceFollower(engine)]
        running = Harness(engine, list(followers))
        running.prime(running.followers, random.Random("plugin-prime"))
        yield running
    finally:
        for follower in followers:
            follower.close()
        engine.stop()
        shutil.rmtree(engine.directory, ignore_errors=True)


def test_vllm_publishes_through_our_publisher(harness: Harness) -> None:
    """The engine's publisher is ours, and shared prefixes and evictions are predicted exactly."""
    assert harness.engine.publisher_class == "kvevents.integrations.vllm.VllmPublisher"
    loaded = harness.engine.kvevents_file
    assert loaded is not None and Path(loaded).resolve() == Path(kvevents.__file__).resolve()
    rng = random.Random("plugin-work")
    system = tokens(rng, 2 * BLOCK)
    prompts = [system + tokens(rng, 3 * BLOCK + 5) for _ in range(7)]
    rows = [harness.request(prompts[i]) for i in (0, 1, 0, 2, 3, 4, 5, 6, 0, 1)]
    assert harness.disagreements(rows) == []
    actual = [r.actual for r in rows]
    assert actual[:3] == [0, 2 * BLOCK, 5 * BLOCK], "shared prefix, then the whole prompt"
    (index,) = [f for f in harness.followers if isinstance(f, IndexFollower)]
    assert index.index.stats().removed_blocks > 0
    assert min(actual[-2:]) < 5 * BLOCK, "a returning prompt lost blocks to evictions"


def test_late_subscriber_replays_from_our_ring(harness: Harness) -> None:
    """A subscriber started late rebuilds the engine's state from our publisher's replay."""
    late = IndexFollower(harness.engine, name="late-index")
    try:
        harness.prime([late], random.Random("plugin-late"))
        harness.sync()
        assert late.stream().replayed > 0
        (first,) = [f for f in harness.followers if isinstance(f, IndexFollower)]
        assert late.index.snapshot() == first.index.snapshot()
    finally:
        late.close()


class _Batch(msgspec.Struct, array_like=True):
    """The shape of vLLM's batch struct: an array of ts, events and the rank (``docs/wire.md``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_plugin_publisher_sends_every_vllm_era_on_our_wire(tmp_path: Path) -> None:
    """Without vLLM: each vLLM-era batch goes out as encoded; an unstamped struct gets our rank."""
    fixtures = [f for f in wire_fixtures() if f.engine.startswith("vllm")]
    base = f"ipc://{tmp_path}/pub"
    publisher = VllmPublisher(
        data_parallel_rank=0,
        endpoint=base,
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=100,
        hwm=1000,
        max_queue_size=100,
        topic="",
        future_field=True,
    )
    try:
        for fixture in fixtures:
            publisher.publish(msgspec.Raw(fixture.payload))  # what msgspec sends is the payload
        publisher.publish(_Batch(1.0, []))
        assert publisher.published_batches() == len(fixtures) + 1
        spec = StreamSpec("w", 0, base, f"ipc://{tmp_path}/replay")
        with Subscriber([spec]) as subscriber:
            got = _drain_after_handshake(publisher, subscriber, len(fixtures) + 1)
    finally:
        publisher.shutdown()
    assert [b.events for b in got[:-1]] == [f.expected.events for f in fixtures]
    sent = [f.expected.data_parallel_rank for f in fixtures]
    assert [b.data_parallel_rank for b in got[:-1]] == sent, "a payload goes out as encoded"
    assert got[-1].data_parallel_rank == 0, "vLLM's unstamped batch gets the publisher's rank"


def _drain_after_handshake(
    publisher: VllmPublisher, subscriber: Subscriber, count: int
) -> list[KVEventBatch]:
    """The first ``count`` batches: a late join, so heartbeat-like empty batches reveal them."""
    batches: dict[int, KVEventBatch] = {}
    deadline = Deadline(20.0)
    while len([s for s in batches if s < count]) < count and not deadline.expired:
        publisher.publish(msgspec.Raw(msgspec.msgpack.encode([0.0, [], None])))
        while (item := subscriber.get(timeout=0.05)) is not None:
            if isinstance(item, Delivery):
                batches[item.seq] = item.batch
    return [batches[s] for s in range(count) if s in batches]
