"""Engine discovery (kvevents.integrations.discovery) against a local HTTP server in SGLang's
``/server_info`` shape, and ``kvevents listen --engine`` and ``kvevents serve --engine``."""

from __future__ import annotations

import http.server
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvevents.cli import main
from kvevents.deadline import Deadline
from kvevents.errors import DiscoveryError
from kvevents.events import BlockStored, KVEventBatch
from kvevents.integrations.discovery import MAX_ANSWER_BYTES, discover, parse_server_info
from kvevents.publish import PublisherOptions
from kvevents.service import WorkerRegistration
from kvevents.testing.hostile_http import HostileHttpServer, dripping, flooding
from kvevents.testing.publisher import local_config, started_publisher


def kv_events(**overrides: Any) -> dict[str, Any]:
    """SGLang's ``kv_events`` descriptor: a wildcard bind host, two DP ranks, no replay."""
    kv = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 16,
        "dp_size": 2,
    }
    kv.update(overrides)
    return kv


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers each path from ``pages``: (status, body bytes); anything else is a 404."""

    pages: ClassVar[dict[str, tuple[int, bytes]]] = {}

    def do_GET(self) -> None:
        status, body = self.pages.get(self.path, (404, b"{}"))
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        """Quiet."""


class Engine:
    """A stand-in engine HTTP server on a free loopback port."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def serve(self, path: str, body: Any, status: int = 200) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        _Handler.pages[path] = (status, raw)


@pytest.fixture
def engine() -> Iterator[Engine]:
    _Handler.pages = {}
    e = Engine()
    e.thread.start()
    yield e
    e.server.shutdown()
    e.server.server_close()
    e.thread.join(5)


def test_sglang_descriptor_gives_every_rank_at_the_url_host(engine: Engine) -> None:
    """A wildcard host is replaced by the URL's host; dp_size ranks, block size and topic kept."""
    engine.serve("/server_info", {"version": "x", "kv_events": kv_events(topic="kv")})
    found = discover(engine.url)
    assert found.endpoint == "tcp://127.0.0.1:5557" and found.replay_endpoint is None
    assert (found.ranks, found.block_size, found.topic) == (2, 16, "kv")
    assert found.url == engine.url + "/server_info"
    streams = found.streams("sg")
    assert [(s.worker_id, s.rank, s.endpoint, s.topic) for s in streams] == [
        ("sg", 0, "tcp://127.0.0.1:5557", "kv"),
        ("sg", 1, "tcp://127.0.0.1:5558", "kv"),
    ]


def test_replay_port_and_explicit_host_are_used(engine: Engine) -> None:
    """replay_endpoint_port_base gives every rank a replay endpoint; a real host is kept."""
    kv = kv_events(endpoint_host="10.1.2.3", replay_endpoint_port_base=5600)
    engine.serve("/server_info", {"kv_events": kv})
    found = discover(engine.url + "/")
    assert found.endpoint == "tcp://10.1.2.3:5557"
    assert [s.replay_endpoint for s in found.streams("sg")] == [
        "tcp://10.1.2.3:5600",
        "tcp://10.1.2.3:5601",
    ]
    reg = WorkerRegistration(**found.registration_fields("sg"), model_name="m")
    assert (reg.endpoint, reg.replay_endpoint, reg.block_size, reg.ranks, reg.model_name) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:5600",
        16,
        (0, 1),
        "m",
    )


def test_older_engines_answer_get_server_info(engine: Engine) -> None:
    """When /server_info is a 404, /get_server_info (older SGLang) is read."""
    engine.serve("/get_server_info", {"kv_events": kv_events(dp_size=1)})
    found = discover(engine.url)
    assert found.url.endswith("/get_server_info") and found.ranks == 1


def test_a_url_naming_the_page_is_read_as_given(engine: Engine) -> None:
    """A URL ending in /server_info is not extended."""
    engine.serve("/server_info", {"kv_events": kv_events()})
    assert discover(engine.url + "/server_info").url == engine.url + "/server_info"


def test_ipv6_hosts_get_brackets() -> None:
    """An IPv6 host (advertised, or the URL's for a wildcard) is bracketed in the endpoint."""
    found = parse_server_info({"kv_events": kv_events(endpoint_host="::")}, "http://[::1]:30000")
    assert found.endpoint == "tcp://[::1]:5557"
    found = parse_server_info({"kv_events": kv_events(endpoint_host="fd00::5")}, "http://h:1")
    assert found.endpoint == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize(
    ("info", "key", "words"),
    [
        ({"version": "x"}, "kv_events", "kv_events is missing"),
        ({"kv_events": None}, "kv_events", "publishes no KV events"),
        ({"kv_events": [1]}, "kv_events", "not an object"),
        (
            {"kv_events": kv_events(publisher="null")},
            "kv_events.publisher",
            "not one of 'zmq', 'kvevents'",
        ),
        (
            {"kv_events": {k: v for k, v in kv_events().items() if k != "endpoint_port_base"}},
            "kv_events.endpoint_port_base",
            "kv_events.endpoint_port_base is missing",
        ),
        (
            {"kv_events": {k: v for k, v in kv_events().items() if k != "endpoint_host"}},
            "kv_events.endpoint_host",
            "is missing",
        ),
        (
            {"kv_events": kv_events(endpoint_port_base=70000)},
            "kv_events.endpoint_port_base",
            "1..65535",
        ),
        (
            {"kv_events": kv_events(replay_endpoint_port_base="x")},
            "kv_events.replay_endpoint_port_base",
            "1..65535",
        ),
        ({"kv_events": kv_events(block_size=0)}, "kv_events.block_size", ">= 1"),
        ({"kv_events": kv_events(dp_size=True)}, "kv_events.dp_size", ">= 1"),
        ({"kv_events": kv_events(topic=3)}, "kv_events.topic", "not a string"),
    ],
)
def test_bad_descriptors_name_the_url_and_the_key(
    engine: Engine, info: Any, key: str, words: str
) -> None:
    """Each missing or invalid field raises DiscoveryError naming the URL and the key."""
    engine.serve("/server_info", info)
    with pytest.raises(DiscoveryError, match=words) as caught:
        discover(engine.url)
    assert caught.value.key == key
    assert caught.value.url == engine.url + "/server_info"
    assert str(caught.value).startswith(engine.url)


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        (500, b"{}", "HTTP 500"),
        (200, b"<html>", "not JSON"),
        (200, b"[1, 2]", "JSON list, not an object"),
    ],
)
def test_bad_answers_are_clear_errors(engine: Engine, status: int, body: bytes, words: str) -> None:
    """An HTTP error or an answer that is not a JSON object is a DiscoveryError saying so."""
    engine.serve("/server_info", body, status)
    with pytest.raises(DiscoveryError, match=words) as caught:
        discover(engine.url)
    assert caught.value.key is None


def test_no_page_at_all(engine: Engine) -> None:
    """Both page names answering 404 is one error naming both."""
    with pytest.raises(DiscoveryError, match="/server_info, /get_server_info"):
        discover(engine.url)


def test_unreachable_and_silent_engines_fail_within_the_timeout() -> None:
    """A refused connection, or a server that never answers, fails within the timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts connections (backlog) but never answers
        with pytest.raises(DiscoveryError, match=r"no answer within 0\.2s"):
            discover(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.2)
        port = silent.getsockname()[1]
    with pytest.raises(DiscoveryError, match="cannot connect"):
        discover(f"http://127.0.0.1:{port}", timeout=2)


@pytest.mark.parametrize(
    ("field", "value", "key", "words"),
    [
        ("dp_size", 10**8, "kv_events.dp_size", "<= 1024"),
        ("block_size", 2**70, "kv_events.block_size", "<= 1048576"),
        (
            "endpoint_port_base",
            65000,
            "kv_events.endpoint_port_base",
            "65000 + 999 (kv_events.dp_size - 1) exceeds 65535",
        ),
        (
            "replay_endpoint_port_base",
            65500,
            "kv_events.replay_endpoint_port_base",
            "exceeds 65535",
        ),
        ("topic", "t" * 257, "kv_events.topic", "over 256 characters"),
        ("endpoint_host", "h" * 2000, "kv_events.endpoint_host", "over 1012 characters"),
        ("endpoint_host", "not a host!", "kv_events.endpoint_host", "is not a host"),
        ("publisher", "p" * 100_000, "kv_events.publisher", "(100002 characters)"),
    ],
)
def test_advertised_fields_have_the_bounds_of_a_registration_over_http(
    field: str, value: Any, key: str, words: str
) -> None:
    """Every advertised field is held to the bound POST /register has (dp_size 10**8 used to
    build 10**8 ranks: 5.5 GB and 19 s; block_size 2**70 was accepted); the error names the
    key, and a value megabytes long is shown cut short."""
    info = {"kv_events": kv_events(**{"dp_size": 1000, field: value})}
    began = time.monotonic()
    with pytest.raises(DiscoveryError, match=re.escape(words)) as caught:
        parse_server_info(info, "http://h:1/server_info")
    assert time.monotonic() - began < 1.0  # generous: it is a few comparisons
    assert caught.value.key == key and len(str(caught.value)) < 300


def test_the_bounds_are_the_http_registrations() -> None:
    """One home for the numbers: discovery, the HTTP bodies' bounds and the settings take the
    same."""
    from kvevents import bounds
    from kvevents.service import _bounds as fields

    assert (fields.MAX_RANKS, fields.MAX_BLOCK_SIZE) == (bounds.MAX_RANKS, bounds.MAX_BLOCK_SIZE)
    top = kv_events(dp_size=bounds.MAX_RANKS, block_size=bounds.MAX_BLOCK_SIZE)
    top["endpoint_port_base"] = 1
    found = parse_server_info({"kv_events": top}, "http://h:1")
    assert (found.ranks, found.block_size) == (bounds.MAX_RANKS, bounds.MAX_BLOCK_SIZE)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + b"x-pad: " + b"y" * 10_000,
        b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b" " * 100_000,
    ],
    ids=["headers", "body"],
)
def test_a_dripping_engine_is_cut_off_at_the_discovery_deadline(answer: bytes) -> None:
    """A server sending a byte every 50 ms answers each read in time, and used to hold serve
    45 s past --discovery-timeout 3; the timeout is now the whole discovery's."""
    drip = HostileHttpServer(answer)
    try:
        began = time.monotonic()
        with pytest.raises(DiscoveryError, match=r"no answer within 1s"):
            discover(drip.url, timeout=1.0)
        took = time.monotonic() - began
    finally:
        drip.close()
    assert 0.9 < took < 2.0, took


def test_serve_gives_up_on_a_dripping_engine_at_its_discovery_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """serve --discovery-timeout 1 stops within about a second on an engine that drips its
    answer (status 1, one line naming the URL); an --engine id over 256 characters is refused
    before any request."""
    drip = dripping()
    try:
        began = time.monotonic()
        status = main(["serve", "--port", "0", "--discovery-timeout", "1", "--engine", drip.url])
        took = time.monotonic() - began
    finally:
        drip.close()
    err = capsys.readouterr().err.strip()
    assert status == 1 and took < 2.5
    assert err == f"kvevents serve: error: {drip.url}/server_info: no answer within 1s"
    assert main(["serve", "--port", "0", "--engine", f"{'w' * 257}={drip.url}"]) == 2
    assert "the worker id is over 256 characters" in capsys.readouterr().err


def test_an_https_engine_that_never_answers_is_cut_off_too() -> None:
    """https:// goes through the same deadline (its TLS handshake included)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        began = time.monotonic()
        with pytest.raises(DiscoveryError, match=r"no answer within 0\.5s"):
            discover(f"https://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
        # Bounded, not timed: the handshake never ends, so without the deadline this waits for
        # the test's own timeout; a loaded machine (it took 3 s once in CI-like load) is slack.
        assert time.monotonic() - began < 5


def test_a_huge_answer_is_refused_after_its_limit() -> None:
    """A 200 MB answer is refused once 4 MiB are read (it used to be read whole: 1.9 GB)."""
    flood = flooding()
    tracemalloc.start()
    try:
        with pytest.raises(DiscoveryError, match=f"over {MAX_ANSWER_BYTES} bytes"):
            discover(flood.url, timeout=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        flood.close()
    assert peak < 3 * MAX_ANSWER_BYTES, peak


def test_deeply_nested_json_is_an_error_naming_the_url(engine: Engine) -> None:
    """100,000 nested arrays used to raise a RecursionError naming nothing; now the URL."""
    engine.serve("/server_info", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(DiscoveryError, match="nested too deeply") as caught:
        discover(engine.url)
    assert str(caught.value).startswith(f"{engine.url}/server_info: ")


def test_not_an_http_url() -> None:
    """A URL without http(s) and a host is refused before any request."""
    with pytest.raises(DiscoveryError, match="http:// or https://"):
        discover("tcp://127.0.0.1:5557")


def test_listen_engine_reads_the_advertised_streams(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvevents listen --engine ID=URL`` subscribes to what the engine advertises."""
    options = PublisherOptions(heartbeat_interval=0.05)
    with started_publisher(options=options) as pub:
        assert pub.endpoint is not None and pub.replay_endpoint is not None
        kv = kv_events(
            endpoint_host="127.0.0.1",
            endpoint_port_base=int(pub.endpoint.rsplit(":", 1)[1]),
            replay_endpoint_port_base=int(pub.replay_endpoint.rsplit(":", 1)[1]),
            dp_size=1,
            block_size=4,
        )
        engine.serve("/server_info", {"kv_events": kv})
        block = BlockStored(block_hashes=[1], token_ids=[1, 2, 3, 4], block_size=4)
        for _ in range(2):
            pub.publish(KVEventBatch(ts=time.time(), events=[block]))
        status = main(
            ["listen", "--engine", f"sg={engine.url}", "--json", "--count", "2", "--duration", "20"]
        )
    out, err = capsys.readouterr()
    assert status == 0
    batches = [r for r in map(json.loads, out.splitlines()) if r["type"] == "batch"]
    assert [(b["worker"], b["rank"], b["seq"]) for b in batches] == [("sg", 0, 0), ("sg", 0, 1)]
    assert "sg: 1 rank(s) at tcp://127.0.0.1:" in err


def test_listen_engine_failure_is_one_line(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine without KV events makes listen fail with one line naming the URL, status 1."""
    engine.serve("/server_info", {"kv_events": None})
    assert main(["listen", "--engine", engine.url, "--count", "1"]) == 1
    err = capsys.readouterr().err
    assert f"kvevents listen: error: {engine.url}/server_info: kv_events is missing" in err


class Serve:
    """``kvevents serve`` in a subprocess; ``url`` once it says "serving on"."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvevents.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def url(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith("serving on "), f"serve did not start: {line!r} {self.stop()}"
        return line.removeprefix("serving on ").strip()

    def stop(self) -> str:
        """SIGTERM, then the stderr it wrote (killed after a bound)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
        return err


def test_serve_engine_registers_every_rank_and_indexes_it(engine: Engine) -> None:
    """``kvevents serve --engine ID=URL`` registers each advertised DP rank with replay, block
    size and topic, and indexes what rank 0 publishes."""
    import httpx

    options = PublisherOptions(heartbeat_interval=0.05)
    with started_publisher(local_config(topic="kv"), options=options) as pub:
        assert pub.endpoint is not None and pub.replay_endpoint is not None
        kv = kv_events(
            endpoint_host="127.0.0.1",
            endpoint_port_base=int(pub.endpoint.rsplit(":", 1)[1]),
            replay_endpoint_port_base=int(pub.replay_endpoint.rsplit(":", 1)[1]),
            publisher="kvevents",
            topic="kv",
            block_size=4,
        )
        engine.serve("/server_info", {"kv_events": kv})
        block = BlockStored(block_hashes=[7], token_ids=[1, 2, 3, 4], block_size=4)
        pub.publish(KVEventBatch(ts=time.time(), events=[block]))
        serve = Serve("--engine", f"sg={engine.url}")
        try:
            url = serve.url()
            workers = httpx.get(f"{url}/workers").json()
            deadline = Deadline(20.0)
            while not httpx.get(f"{url}/dump").json()["holders"]:
                assert not deadline.expired, "nothing indexed in time"
                time.sleep(0.05)
            query = httpx.post(f"{url}/query", json={"token_ids": [1, 2, 3, 4, 5]}).json()
        finally:
            err = serve.stop()
    (worker,) = workers["workers"]
    assert (worker["worker_id"], worker["block_size"], worker["topic"]) == ("sg", 4, "kv")
    assert [r["rank"] for r in worker["ranks"]] == [0, 1]
    assert worker["replay_endpoint"] == pub.replay_endpoint.replace("0.0.0.0", "127.0.0.1")
    assert "sg: 2 rank(s) at tcp://127.0.0.1:" in err and "block size 4" in err
    assert query["scores"] == {"sg": {"0": 1}}, "the block rank 0 stored is matched there"


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ({"version": "x"}, "/server_info: kv_events is missing"),
        ({"kv_events": kv_events(publisher="null")}, "kv_events.publisher is 'null'"),
    ],
)
def test_serve_engine_without_events_fails_in_one_line(
    engine: Engine, info: Any, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that advertises no (usable) KV events stops serve before it serves: status 1,
    one line naming the URL and the key."""
    engine.serve("/server_info", info)
    assert main(["serve", "--port", "0", "--engine", engine.url]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvevents serve: error: {engine.url}") and words in err
    assert "\n" not in err


def test_serve_engine_unreachable_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An engine nobody answers for is one line saying it cannot connect, status 1."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    status = main(
        ["serve", "--port", "0", "--discovery-timeout", "2", "--engine", f"http://127.0.0.1:{port}"]
    )
    err = capsys.readouterr().err.strip()
    assert status == 1 and "cannot connect" in err and f"127.0.0.1:{port}" in err


def test_serve_engine_name_clash_is_a_usage_error(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --engine named like a --worker is refused before any request (status 2)."""
    argv = ["serve", "--worker", "a=tcp://127.0.0.1:5557", "--engine", f"a={engine.url}"]
    assert main(argv) == 2
    assert "worker 'a' is given twice" in capsys.readouterr().err


def test_serve_engines_come_from_the_settings_file_too(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``engines`` and ``discovery_timeout`` are [serve] keys like every serve flag."""
    engine.serve("/server_info", {"kv_events": None})
    config = tmp_path / "serve.toml"
    config.write_text(f'[serve]\nengines = ["sg={engine.url}"]\ndiscovery_timeout = 2\n')
    assert main(["serve", "--port", "0", "--config", str(config)]) == 1
    assert f"{engine.url}/server_info: kv_events is missing" in capsys.readouterr().err
