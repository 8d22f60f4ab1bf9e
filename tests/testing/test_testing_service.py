"""kvevents.testing.service: our index service as a subprocess peer, driven over HTTP."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

import pytest

from kvevents.config import KVEventsConfig
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publish import create_publisher
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


def test_serve_options_close_the_mutating_endpoints_and_choose_the_hosts(tmp_path: Path) -> None:
    """kvevents serve reads the token from $KVEVENTS_AUTH_TOKEN (or --auth-token-file) and the
    allowed endpoint hosts from --allow-endpoint-host, which replace the loopback default."""
    env = {"KVEVENTS_AUTH_TOKEN": "t0ken"}
    with ServiceIndexer(args=["--allow-endpoint-host", "10.0.0.0/8"], env=env) as service:
        body = {"worker_id": "w", "endpoint": "tcp://10.1.2.3:5557", "block_size": BS}
        status, reply = service.send("POST", "/register", json.dumps(body).encode())
        assert status == 401 and b"Bearer" in reply
        assert service.send("GET", "/health")[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10.0)
        try:
            headers = {"Authorization": "Bearer t0ken"}
            conn.request("POST", "/register", json.dumps(body), headers)
            accepted = conn.getresponse()
            assert accepted.status == 200, accepted.read()
            accepted.read()
            local = {**body, "endpoint": "tcp://127.0.0.1:5557"}
            conn.request("POST", "/register", json.dumps(local), headers)
            refused = conn.getresponse()
            assert refused.status == 403 and b"127.0.0.1" in refused.read()
        finally:
            conn.close()
        assert [w["worker_id"] for w in service.workers()] == ["w"]
    token = tmp_path / "token"
    token.write_text("")
    for args in (["--auth-token-file", str(token)], ["--auth-reads"]):
        with pytest.raises(ServiceIndexerError, match="exited with status 2"):
            ServiceIndexer(args=args, startup_timeout=20.0).start()
