"""kvevents.testing.service: our index service as a subprocess peer, driven over HTTP."""

from __future__ import annotations

import json
import os

import pytest

from kvevents.config import KVEventsConfig
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publish.publisher import create_publisher
from kvevents.testing.service import ServiceIndexer, ServiceIndexerError
from kvevents.testing.sockets import wait_for

BS = 4
PROMPT = list(range(500, 524))  # 6 blocks
PROBE = [1, 2, 3, 4]


def _store(hashes: list[int], parent: int | None, tokens: list[int]) -> KVEventBatch:
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS
    )
    return KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0)


def test_service_peer_indexes_a_real_publisher_and_stops() -> None:
    """Register our publisher with the subprocess service; a query finds what it published."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
    )
    with create_publisher(config) as publisher, ServiceIndexer() as service:
        assert publisher.endpoint is not None and publisher.replay_endpoint is not None
        service.register(
            "w0", publisher.endpoint, block_size=BS, replay_endpoint=publisher.replay_endpoint
        )
        # Published before the service's SUB may be connected: the probes that follow make it
        # see a late join, and the replay from 0 brings these two back.
        publisher.publish(_store([1, 2, 3], None, PROMPT[:12]))
        publisher.publish(_store([4, 5, 6], 3, PROMPT[12:]))

        def indexed() -> bool:
            publisher.publish(_store([99], None, PROBE))
            return service.matched_blocks(PROMPT, BS).get(("w0", 0)) == 6

        wait_for(indexed, timeout=20.0, interval=0.02, what="the publisher's blocks")
        assert service.matched_blocks(PROMPT[:8], BS) == {("w0", 0): 2}
        status, body = service.send("POST", "/query", json.dumps({"token_ids": PROMPT}).encode())
        assert status == 200 and json.loads(body)["scores"] == {"w0": {"0": 6}}
        assert service.rss_bytes() > 0
        pid = service.pid
    with pytest.raises(ServiceIndexerError):
        _ = service.pid
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie_free(pid)


def _is_zombie_free(pid: int) -> bool:
    """A reused pid may exist again; it must not be our (reaped) child still running."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kvevents.cli" not in f.read()
    except OSError:
        return True


def test_service_peer_reports_http_errors_and_a_failed_start() -> None:
    """A 4xx reply raises with the server's message; a service that cannot start says why."""
    with ServiceIndexer() as service:
        with pytest.raises(ServiceIndexerError, match="unknown worker"):
            service.unregister("nobody")
        status, _ = service.send("POST", "/query", b"{not json")
        assert status == 400
    with pytest.raises(ServiceIndexerError, match="exited with status 2"):
        ServiceIndexer(args=["--policy", "no-such-policy"], startup_timeout=20.0).start()
