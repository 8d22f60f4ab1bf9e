"""The status page: the decision ring, GET /status, GET / and its rendering in a real browser."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import signal
import struct
import subprocess
import time
import typing
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvevents.events import BlockStored, KVEventBatch
from kvevents.http import AppOptions, TokenCheck, serve
from kvevents.http._status import page_html, status
from kvevents.index.decision import Decision, Load, TargetScore
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.decisions import DecisionLog
from kvevents.subscribe.streams import FeedState
from kvevents.testing.index import batch, store_event
from kvevents.testing.publisher import started_publisher
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.sockets import wait_for
from test_service import BS, PROMPT, FakeFeed, applied, make_service

TOKEN = "s3cret"
#: Colours of page.html that only data draws: the "live" badge and the hit-rate dots.
LIVE_GREEN = bytes((0x1F, 0x8A, 0x4C))
SPARK_BLUE = bytes((0x2B, 0x6C, 0xB0))


class Clock:
    """A settable clock for DecisionLog."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def decision(matched: int, request: int, worker: str | None = "w", reason: str = "r") -> Decision:
    row = TargetScore(worker or "w", 0, matched, request, float(matched), Load(), {})
    winner = None if worker is None else (worker, 0)
    return Decision(winner, "longest_prefix", (row,), request * BS, 1, reason)


def test_the_ring_keeps_the_last_decisions_newest_first() -> None:
    """Only the last ``size`` decisions are kept, newest first, with who, how much and why."""
    log = DecisionLog(3, clock=Clock())
    for i in range(5):
        log.record(decision(i, 8, reason=f"most matched blocks ({i})"))
    recent = log.recent()
    assert [r.matched_blocks for r in recent] == [4, 3, 2]
    assert recent[0].reason == "most matched blocks (4)" and recent[0].worker_id == "w"
    assert recent[0].request_blocks == 8 and recent[0].request_tokens == 8 * BS
    assert recent[0].time == 1000.0


def test_a_query_without_a_target_is_recorded_as_such() -> None:
    """No winner: no worker, no blocks, and a reason that says so."""
    log = DecisionLog(clock=Clock())
    log.record(Decision(None, "longest_prefix", (), 12, 0))
    (entry,) = log.recent()
    assert entry.worker_id is None and entry.rank is None and entry.reason == "no target"
    assert (entry.matched_blocks, entry.request_blocks) == (0, 0)
    (bucket,) = log.history()
    assert bucket.queries == 1 and bucket.hit_rate is None


def test_the_hit_rate_is_bucketed_by_time_and_old_buckets_are_dropped() -> None:
    """Buckets sum their queries' blocks; buckets past the window leave history and memory."""
    clock = Clock(100.0)
    log = DecisionLog(bucket_seconds=10.0, buckets=3, clock=clock)
    log.record(decision(2, 4))
    clock.now = 105.0
    log.record(decision(4, 4))
    clock.now = 121.0
    log.record(decision(0, 4))
    history = log.history()
    assert [(b.start, b.queries, b.hit_rate) for b in history] == [
        (100.0, 2, 0.75),
        (120.0, 1, 0.0),
    ]
    clock.now = 131.0  # the window is now 110..140: the first bucket is out
    assert [b.start for b in log.history()] == [120.0]
    for step in range(50):
        clock.now = 200.0 + 10 * step
        log.record(decision(1, 1))
    assert len(log._buckets) <= 3  # memory stays bounded, not only the answer


def test_the_log_refuses_a_size_that_keeps_nothing() -> None:
    """A ring or a history of nothing is a configuration error, said at construction."""
    for kwargs in ({"size": 0}, {"buckets": 0}, {"bucket_seconds": 0.0}):
        with pytest.raises(ValueError, match="DecisionLog needs"):
            DecisionLog(**kwargs)


def test_status_shows_workers_index_decisions_and_hit_rate() -> None:
    """The service records each query's decision; status() gathers what the page shows."""
    feed = FakeFeed()
    service = make_service(feed)
    with service:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:6000", BS, ranks=(0, 1)))
        feed.deliver("a", 1, batch(store_event(PROMPT, BS, medium="CPU")))
        applied(service, 1)
        service.query(PROMPT)
        service.query(PROMPT[:8] + [7] * 8)
        now = status(service)
    assert now.health == "ok" and now.queries == 2
    assert now.index.blocks == 6 and now.index.entries == 6
    (worker,) = now.workers
    assert worker.worker_id == "a" and [r.rank for r in worker.ranks] == [0, 1]
    assert [r.state for r in worker.ranks] == ["live", "live"]
    assert worker.ranks[1].tiers == {"CPU": 6} and worker.ranks[1].blocks == 6
    assert worker.ranks[0].blocks == 0
    newest, oldest = now.decisions
    assert (oldest.worker_id, oldest.rank, oldest.matched_blocks) == ("a", 1, 6)
    assert oldest.reason == "most matched blocks (6)" and newest.matched_blocks == 2
    (bucket,) = now.hit_rate
    assert bucket.queries == 2 and bucket.hit_rate == pytest.approx(8 / 10)


@pytest.fixture
def guarded() -> Iterator[tuple[httpx.Client, IndexService, FakeFeed]]:
    feed = FakeFeed()
    service = make_service(feed)
    options = AppOptions(auth=TokenCheck(TOKEN, protect_reads=True))
    with (
        serve("127.0.0.1", 0, service=service, options=options) as running,
        httpx.Client(base_url=running.url, timeout=10.0) as client,
    ):
        yield client, service, feed


def test_the_page_is_self_contained_and_its_script_is_the_only_one_allowed() -> None:
    """GET / is one HTML document fetching nothing from elsewhere; its CSP names its script."""
    feed = FakeFeed()
    with (
        serve("127.0.0.1", 0, service=make_service(feed)) as running,
        httpx.Client(base_url=running.url, timeout=10.0) as client,
    ):
        page = client.get("/")
        assert client.get("/status").json()["workers"] == []
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"(src|href)=\"?(https?:)?//", page.text)
    assert "@import" not in page.text and "url(" not in page.text
    assert ".innerHTML" not in page.text  # client-chosen strings go in as text nodes only
    (script,) = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = page.headers["content-security-policy"]
    assert f"script-src 'sha256-{digest}'" in policy and "default-src 'none'" in policy
    assert "connect-src 'self'" in policy and page.headers["x-content-type-options"] == "nosniff"


def test_every_health_the_page_shows_has_a_badge_colour_of_its_own() -> None:
    """Each feed state /status reports (ok, degraded, stalled, dead) has a badge rule of the
    page's stylesheet, and degraded's colour is neither ok's nor that of an unknown state."""
    page = page_html().decode()
    colours = {
        name: colour
        for selectors, colour in re.findall(r"([.\w, -]+)\{ background: var\(--(\w+)\); \}", page)
        for name in re.findall(r"\.([\w-]+)", selectors)
    }
    assert set(typing.get_args(FeedState)) <= colours.keys(), colours
    assert colours["degraded"] not in {colours["ok"], colours["unknown"]}


def test_with_auth_reads_the_page_and_its_json_need_the_token(
    guarded: tuple[httpx.Client, IndexService, FakeFeed],
) -> None:
    """--auth-reads puts /, /status and /openapi.json behind the bearer token like any read."""
    client = guarded[0]
    for path in ("/", "/status", "/openapi.json"):
        refused = client.get(path)
        assert refused.status_code == 401 and "Bearer" in refused.json()["error"], path
        allowed = client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert allowed.status_code == 200, path


def test_status_json_carries_recorded_decisions_over_http(
    guarded: tuple[httpx.Client, IndexService, FakeFeed],
) -> None:
    """A /query answered over HTTP shows up in GET /status with its reason."""
    client, service, feed = guarded
    auth = {"Authorization": f"Bearer {TOKEN}"}
    worker = {"worker_id": "a", "endpoint": "tcp://127.0.0.1:6000", "block_size": BS}
    assert client.post("/register", json=worker, headers=auth).status_code == 200
    feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
    applied(service, 1)
    assert client.post("/query", json={"token_ids": PROMPT}, headers=auth).status_code == 200
    body = client.get("/status", headers=auth).json()
    (entry,) = body["decisions"]
    assert entry["worker_id"] == "a" and entry["reason"] == "most matched blocks (6)"
    assert body["hit_rate"][0]["hit_rate"] == 1.0 and body["bucket_seconds"] > 0


# ---------------------------------------------------------------------- the real browser


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser() -> str:
    found = _chromium()
    if found is None:
        if os.environ.get("KVEVENTS_REQUIRE_BROWSER") == "1":
            pytest.fail("KVEVENTS_REQUIRE_BROWSER=1 but chromium is not installed (make browser)")
        pytest.skip("chromium is not installed (make browser installs it with apt)")
    return found


def _run_browser(args: list[str], timeout: float = 90.0) -> bytes:
    """Run headless Chromium to completion; its whole process group is killed on timeout."""
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


def _png_rows(data: bytes) -> list[bytes]:
    """The unfiltered pixel rows of an 8-bit RGB or RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    assert header is not None, "no IHDR chunk"
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * bpp
    rows, prior = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1 : start + 1 + stride])
        _unfilter(raw[start], line, prior, bpp)
        prior = bytes(line)
        rows.append(prior if bpp == 3 else bytes(b for i, b in enumerate(prior) if i % 4 != 3))
    return rows


def _unfilter(kind: int, line: bytearray, prior: bytes, bpp: int) -> None:
    """Undo one row's PNG filter in place (types 0-4, PNG spec section 9)."""
    if kind == 2:
        line[:] = bytes((a + b) & 255 for a, b in zip(line, prior, strict=True))
        return
    for i in range(len(line) if kind else 0):
        left = line[i - bpp] if i >= bpp else 0
        up = prior[i]
        if kind == 1:
            line[i] = (line[i] + left) & 255
        elif kind == 3:
            line[i] = (line[i] + ((left + up) >> 1)) & 255
        else:
            corner = prior[i - bpp] if i >= bpp else 0
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            line[i] = (
                line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)
            ) & 255


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> KVEventBatch:
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS
    )
    return KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0)


@pytest.mark.browser
def test_the_page_renders_live_data_in_a_real_browser(tmp_path: Path) -> None:
    """Chromium renders a real serve's worker (id as text), live state and reasons, not blank."""
    browser = _browser()
    worker = "w0<b>x</b>"  # markup in a client-chosen id must be shown, not parsed
    with started_publisher() as publisher, ServiceIndexer() as service:
        assert publisher.endpoint is not None and publisher.replay_endpoint is not None
        service.register(
            worker, publisher.endpoint, block_size=BS, replay_endpoint=publisher.replay_endpoint
        )
        publisher.publish(_stored([1, 2, 3], None, PROMPT[:12]))
        publisher.publish(_stored([4, 5, 6], 3, PROMPT[12:]))

        def indexed() -> bool:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))  # keeps the lag small
            return service.matched_blocks(PROMPT, BS).get((worker, 0)) == 6

        wait_for(indexed, timeout=20.0, interval=0.02, what="the publisher's blocks")
        for tokens in (PROMPT, PROMPT[:8], list(range(9000, 9016))):
            service.query(tokens)
        url = f"http://127.0.0.1:{service.port}/"
        common = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run"]
        common += [f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
        dom = _run_browser([*common, "--dump-dom", url]).decode()
        shot = tmp_path / "page.png"
        _run_browser([*common, f"--screenshot={shot}", "--window-size=1200,900", url])
    assert "w0&lt;b&gt;x&lt;/b&gt;" in dom and "<b>x</b>" not in dom
    assert "most matched blocks (6)" in dom and "most matched blocks (2)" in dom
    assert re.search(r'class="badge live">live<', dom)
    assert re.search(r'id="n-blocks">6<', dom) and "GPU: 6 (6)" in dom
    assert "<circle" in dom  # the hit-rate sparkline has its point
    rows = _png_rows(shot.read_bytes())
    assert len(rows) == 900 and len(rows[0]) == 1200 * 3
    colours = {row[i : i + 3] for row in rows for i in range(0, len(row), 3)}
    assert len(colours) > 50  # text, badges and rules, not a blank or uniform page
    assert LIVE_GREEN in colours and SPARK_BLUE in colours
    assert sum(len(set(row)) > 1 for row in rows) > 100  # rows with something drawn on them
