"""Two data parallel ranks of a real vLLM server: one stream per rank, hits predicted per rank.

vLLM's OpenAI server (``kvevents.testing.vllm_server.VllmServer``: the same tiny model,
``--data-parallel-size 2``) runs one
engine per rank, and rank r publishes on the base ports + r. Our ``Subscriber`` +
``PrefixIndex`` and ``kvevents serve`` (registered with ``ranks: 2``) follow both. Each request
is sent to a chosen rank (``X-data-parallel-rank``) and its ``cached_tokens`` compared with
what the consumers predicted for that rank.

In this mode vLLM's publishers live in the engine processes, out of reach of a sequence count,
so the consumers are synced by a handshake on state instead: after a request, wait (bounded)
until both hold the prompt's full blocks on that rank. The workload never evicts (each rank
holds 15 blocks), so no removal can be pending when they do.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from vllm_peer import SCRIPT, STARTUP_TIMEOUT, expected_hit, scratch_dir

from kvevents.deadline import Deadline
from kvevents.index.prefix import PrefixIndex
from kvevents.subscribe import Delivery, Subscriber
from kvevents.subscribe.streams import worker_streams
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.vllm_server import VllmServer

pytestmark = [pytest.mark.interop, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
RANKS = 2
WORKER = "vllm-dp"


@dataclass
class DataParallel:
    """The server and both consumers."""

    server: VllmServer
    index: PrefixIndex
    subscriber: Subscriber
    service: ServiceIndexer
    stamps: set[tuple[int, int | None]] = field(default_factory=set)

    def pump(self) -> None:
        while (item := self.subscriber.get(timeout=0.02)) is not None:
            if isinstance(item, Delivery):
                self.index.apply(WORKER, item.stream.rank, item.batch)
                self.stamps.add((item.stream.rank, item.batch.data_parallel_rank))

    def predicted(self, prompt: Sequence[int], rank: int) -> dict[str, int]:
        """Matched blocks on ``rank`` according to each consumer."""
        self.pump()
        ours = self.index.match(prompt).streams.get((WORKER, rank), 0)
        theirs = self.service.matched_blocks(prompt).get((WORKER, rank), 0)
        return {"index": ours, "service": theirs}

    def holds(self, prompt: Sequence[int], rank: int, timeout: float) -> bool:
        """Wait (bounded) until both consumers hold the prompt's full blocks on ``rank``."""
        deadline = Deadline(timeout)
        full = len(prompt) // BLOCK
        while set(self.predicted(prompt, rank).values()) != {full}:
            if deadline.expired:
                return False
        return True

    def run(self, prompt: Sequence[int], rank: int) -> tuple[int, dict[str, int]]:
        """(vLLM's cached tokens, each consumer's prediction) for ``prompt`` on ``rank``."""
        predicted = {
            name: expected_hit(blocks, len(prompt), BLOCK)
            for name, blocks in self.predicted(prompt, rank).items()
        }
        actual = generate(self.server, prompt, rank)
        assert self.holds(prompt, rank, timeout=20.0), f"rank {rank}'s stores never arrived"
        return actual, predicted


def generate(server: VllmServer, prompt: Sequence[int], rank: int) -> int:
    """``cached_tokens`` of one prompt (one output token) run on data parallel ``rank``."""
    body = {"model": server.model, "prompt": list(prompt), "max_tokens": 1}
    reply = server.post_json("/v1/completions", body, headers={"X-data-parallel-rank": str(rank)})
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def dp(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DataParallel]:
    model_dir, logs = tmp_path_factory.mktemp("model"), scratch_dir("kvd-")
    build = [vllm_python, str(SCRIPT), "--build-model", str(model_dir)]
    subprocess.run(build, check=True, timeout=STARTUP_TIMEOUT, capture_output=True)
    server = VllmServer(
        vllm_python, model_dir, block_size=BLOCK, num_blocks=16, ranks=RANKS, log_dir=logs
    )
    try:
        server.start()
        endpoint, replay = server.event_endpoint(), server.replay_endpoint()
        streams = worker_streams(WORKER, endpoint, replay, ranks=RANKS)
        index = PrefixIndex(block_size=BLOCK)
        index.register_worker(WORKER, block_size=BLOCK, ranks=RANKS)
        with Subscriber(streams) as subscriber, ServiceIndexer() as service:
            service.register(
                WORKER, endpoint, block_size=BLOCK, replay_endpoint=replay, ranks=RANKS
            )
            running = DataParallel(server, index, subscriber, service)
            _prime(running)
            yield running
    finally:
        server.stop()
        shutil.rmtree(logs, ignore_errors=True)


def _prime(dp: DataParallel) -> None:
    """Handshake per rank: primer prompts until both consumers saw one (SUBs connect late)."""
    rng = random.Random("dp-prime")
    for rank in range(RANKS):
        for _ in range(5):
            primer = tokens(rng, BLOCK + 1)
            generate(dp.server, primer, rank)
            if dp.holds(primer, rank, timeout=3.0):
                break
        else:
            pytest.fail(f"rank {rank}'s events never reached both consumers")


def test_each_rank_publishes_its_own_stream(dp: DataParallel) -> None:
    """A prompt run on rank 1 is indexed on rank 1 only, from batches stamped with rank 1."""
    prompt = tokens(random.Random("dp-own"), 2 * BLOCK + 3)
    generate(dp.server, prompt, 1)
    assert dp.holds(prompt, 1, timeout=20.0)
    assert dp.predicted(prompt, 0) == {"index": 0, "service": 0}
    assert dp.stamps == {(0, 0), (1, 1)}, "stream r carries batches stamped data_parallel_rank r"


def test_hits_are_predicted_per_rank(dp: DataParallel) -> None:
    """The same prompt is a hit on the rank that ran it and a miss on the other, as predicted."""
    rng = random.Random("dp-hits")
    first, second = tokens(rng, 3 * BLOCK + 4), tokens(rng, 2 * BLOCK + 9)
    plan = [(first, 0), (second, 1), (first, 1), (first, 0), (second, 1), (second, 0)]
    results = [dp.run(prompt, rank) for prompt, rank in plan]
    assert [actual for actual, _ in results] == [0, 0, 0, 96, 64, 0]
    for (actual, predicted), (prompt, rank) in zip(results, plan, strict=True):
        assert set(predicted.values()) == {actual}, (len(prompt), rank, actual, predicted)
