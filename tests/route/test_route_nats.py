"""``kvevents route --nats``: the front door's index from the relay's JetStream stream (a
real nats-server), not from the engines themselves."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvevents.events import BlockStored, KVEventBatch
from kvevents.route._tokens import ModelTokenizer
from kvevents.service.feed import WorkerRegistration
from kvevents.testing.nats import NatsServer, find_nats_server
from kvevents.testing.openai_engine import StandInEngine
from kvevents.testing.publisher import started_publisher
from kvevents.testing.route import RouteProcess

if find_nats_server() is None:
    if os.environ.get("KVEVENTS_REQUIRE_NATS") == "1":
        pytest.fail("nats-server is required (KVEVENTS_REQUIRE_NATS=1) but not installed")
    pytest.skip("nats-server not installed (pip install 'kvevents[nats]')", allow_module_level=True)

from kvevents.scaleout import JetStreamOptions, Relay

BLOCK = 16
BODY = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You route requests where their prefix is cached. " * 6},
        {"role": "user", "content": "Which engine holds this?"},
    ],
}


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as started:
        yield started


def test_the_front_door_predicts_from_the_replicas_stream(
    nats_server: NatsServer, chat_model_tokenizer: Path
) -> None:
    """Blocks an engine announced reach the front door through the relay and JetStream: a
    request for their prefix is predicted as cached there."""
    tokens = ModelTokenizer.load(chat_model_tokenizer, model_name="tiny").chat(BODY).token_ids
    assert tokens is not None
    blocks = len(tokens) // BLOCK
    js = JetStreamOptions(stream="ROUTE", prefix="route", bucket="route-snapshots")
    with started_publisher() as publisher, StandInEngine(("tiny",)).start() as engine:
        reg = WorkerRegistration("e0", publisher.endpoint, BLOCK, (0,), publisher.replay_endpoint)
        with Relay(nats_server.url, [reg], jetstream=js).start():
            args = [
                "route", "--port", "0", "--tokenizer", str(chat_model_tokenizer),
                "--block-size", str(BLOCK), "--engine", f"e0={engine.url}",
                "--nats", nats_server.url, "--nats-stream", "ROUTE", "--nats-prefix", "route",
                "--nats-bucket", "route-snapshots", "--prediction-grace", "0",
            ]  # fmt: skip
            with RouteProcess(args) as route:
                first = httpx.post(f"{route.url}/v1/chat/completions", json=BODY, timeout=30)
                assert first.headers["x-kvevents-predicted-cached-tokens"] == "0"
                stored = BlockStored(
                    block_hashes=list(range(1, blocks + 1)),
                    parent_block_hash=None,
                    token_ids=list(tokens[: blocks * BLOCK]),
                    block_size=BLOCK,
                )
                publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
                deadline = time.monotonic() + 20
                while True:
                    reply = httpx.post(f"{route.url}/v1/chat/completions", json=BODY, timeout=30)
                    predicted = int(reply.headers["x-kvevents-predicted-cached-tokens"])
                    if predicted or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
    assert predicted == min(blocks, (len(tokens) - 1) // BLOCK) * BLOCK
