"""Every ``kvevents`` command end to end, in a subprocess, against real publishers."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from kvevents.events import BlockStored, KVEventBatch
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.peers import RawPublisher
from kvevents.testing.publisher import connectable, local_config, started_publisher
from kvevents.testing.sockets import Deadline

TIMEOUT = 30.0


class Proc:
    """A ``python -m kvevents.cli`` child whose output lines are read with deadlines."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvevents.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(
            target=self._pump, args=(self.popen.stdout, self.lines), daemon=True
        ).start()
        self._err_thread = threading.Thread(target=self._collect_err, daemon=True)
        self._err_thread.start()

    @staticmethod
    def _pump(stream: Any, out: queue.Queue[str | None]) -> None:
        for line in stream:
            out.put(line.rstrip("\n"))
        out.put(None)

    def _collect_err(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.err.append(line)

    def line(self, timeout: float = TIMEOUT) -> str | None:
        """The next stdout line (None at end of output); TimeoutError past the deadline."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"no output within {timeout}s; stderr: {''.join(self.err)}"
            ) from None

    def rest(self, timeout: float = TIMEOUT) -> list[str]:
        """Every remaining stdout line, until the child closes it."""
        deadline = Deadline(timeout)
        out: list[str] = []
        while (line := self.line(max(0.01, deadline.remaining()))) is not None:
            out.append(line)
        return out

    def wait(self, timeout: float = TIMEOUT) -> int:
        """The exit status, once the child exited and all of its stderr has been read."""
        status = self.popen.wait(timeout=timeout)
        self._err_thread.join(timeout)
        return status

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


@contextmanager
def cli(*args: str) -> Iterator[Proc]:
    proc = Proc(*args)
    try:
        yield proc
    finally:
        proc.kill()


def until(
    condition: Callable[[], bool], action: Callable[[], object], timeout: float = TIMEOUT
) -> None:
    """Run ``action`` (e.g. publish a probe) until ``condition`` holds, within the deadline."""
    deadline = Deadline(timeout)
    while not condition():
        if deadline.expired:
            raise TimeoutError("condition not met within the deadline")
        action()
        time.sleep(0.005)


def records(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def stored(i: int) -> KVEventBatch:
    block = BlockStored(
        block_hashes=[i + 1], parent_block_hash=None, token_ids=[i] * 4, block_size=4
    )
    return KVEventBatch(ts=time.time(), events=[block])


def wait_published(publisher: Any, count: int) -> None:
    deadline = Deadline(TIMEOUT)
    while publisher.stats().published < count:
        assert not deadline.expired, "publisher did not send its batches in time"
        time.sleep(0.002)


# ---------------------------------------------------------------------- listen


def test_listen_json_late_join_replays_from_zero() -> None:
    """listen joining late replays from seq 0 and prints one JSON object per batch, in order."""
    with started_publisher() as pub:
        for i in range(5):
            pub.publish(stored(i))
        worker = f"eng={connectable(pub.endpoint)},{connectable(pub.replay_endpoint)}"
        with cli("listen", "--worker", worker, "--json", "--count", "5") as proc:
            until(proc.exited, lambda: pub.publish(heartbeat()))
            assert proc.wait() == 0
            out = records(proc.rest())
    batches = [r for r in out if r["type"] == "batch"]
    assert [b["seq"] for b in batches] == [0, 1, 2, 3, 4]
    assert all(b["worker"] == "eng" and b["rank"] == 0 for b in batches)
    assert [b["summary"]["stored"] for b in batches] == [1] * 5
    assert {"type": "gap", "worker": "eng", "rank": 0, "after_seq": None} in out
    summary = out[-1]
    assert summary["type"] == "summary" and summary["batches"] == 5
    assert summary["streams"][0]["gaps"] == 1 and summary["streams"][0]["missing"] == 0
    assert "listening to 1 stream\n" in "".join(proc.err)


def test_listen_without_replay_reports_unrecoverable_range() -> None:
    """Without a replay endpoint, the batches before the first one seen are reported lost."""
    with started_publisher(local_config(replay_endpoint=None)) as pub:
        pub.publish(stored(0))
        pub.publish(stored(1))
        with cli("listen", connectable(pub.endpoint), "--json", "--count", "3", "--full") as proc:
            until(proc.exited, lambda: pub.publish(heartbeat()))
            assert proc.wait() == 0
            out = records(proc.rest())
    lost = [r for r in out if r["type"] == "unrecoverable"]
    first = next(r for r in out if r["type"] == "batch")
    assert lost and lost[0]["missing"] == [0, first["seq"]] and first["seq"] >= 2
    assert first["worker"] == "w0" and first["events"] == []
    assert out[-1]["streams"][0]["state"] == "incomplete"


def test_listen_plain_calls_out_a_restart() -> None:
    """A publisher restart shows as a call-out line, and the summary counts it."""
    with RawPublisher() as raw:
        worker = f"raw={raw.endpoint},{raw.replay_endpoint}"
        with cli("listen", "--worker", worker, "--plain") as proc:
            seen: list[str] = []
            until(lambda: bool(seen), lambda: seen.extend(_poll(proc)) or raw.publish(heartbeat()))
            raw.restart()
            step = iter(range(1, 10_000))
            until(lambda: any("restarted" in s for s in seen),
                  lambda: seen.extend(_poll(proc)) or raw.publish(typical_batch(next(step))))  # fmt: skip
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.wait() == 0
            tail = proc.rest()
    assert any("raw/0 !! publisher restarted" in s for s in seen)
    assert tail[-2].startswith("summary:") and "1 restart," in tail[-1]


def _poll(proc: Proc) -> list[str]:
    out: list[str] = []
    while True:
        try:
            line = proc.lines.get_nowait()
        except queue.Empty:
            return out
        if line is not None:
            out.append(line)


# ---------------------------------------------------------------------- replay


def test_replay_fetches_an_inclusive_range() -> None:
    """replay --from/--to prints exactly that range, then an end record."""
    with started_publisher() as pub:
        for i in range(10):
            pub.publish(stored(i))
        wait_published(pub, 10)
        endpoint = connectable(pub.replay_endpoint)
        with cli("replay", endpoint, "--from", "3", "--to", "6", "--json") as proc:
            assert proc.wait() == 0
            out = records(proc.rest())
        with cli("replay", endpoint, "--from", "0") as proc:
            assert proc.wait() == 0
            text = proc.rest()
    assert [r["seq"] for r in out if r["type"] == "batch"] == [3, 4, 5, 6]
    assert out[-1]["type"] == "end" and out[-1]["batches"] == 4 and not out[-1]["end_marker"]
    assert len(text) == 11 and text[0].startswith("seq=0 ")
    assert text[-1] == "end: 10 batches, end marker"


def test_replay_reports_a_trimmed_start() -> None:
    """A ring that moved on is reported (first held seq) and exits with status 3."""
    with started_publisher(local_config(buffer_steps=4)) as pub:
        for i in range(10):
            pub.publish(stored(i))
        wait_published(pub, 10)
        with cli("replay", connectable(pub.replay_endpoint), "--from", "0", "--json") as proc:
            assert proc.wait() == 3
            out = records(proc.rest())
    assert out[0] == {"type": "trimmed", "asked": 0, "first": 6}
    assert [r["seq"] for r in out if r["type"] == "batch"] == [6, 7, 8, 9]
    assert out[-1]["end_marker"] is True


def test_replay_times_out_on_a_silent_endpoint() -> None:
    """A replay endpoint that never answers gives one error line and exit status 1."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        router.bind("tcp://127.0.0.1:0")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        with cli("replay", endpoint, "--from", "0", "--timeout", "0.3") as proc:
            assert proc.wait() == 1
    finally:
        router.close(0)
    assert "".join(proc.err).strip() == (
        f"kvevents replay: error: no reply from {endpoint} within 0.3s"
    )


# ---------------------------------------------------------------------- publish + listen


def test_publish_and_listen_together() -> None:
    """publish (two ranks) feeds listen; each rank arrives complete from seq 0, in order."""
    with cli("publish", "--endpoint", "tcp://127.0.0.1:0", "--replay-endpoint",
             "tcp://127.0.0.1:0", "--ranks", "2", "--rate", "200", "--json") as pub:  # fmt: skip
        ready = json.loads(pub.line() or "{}")
        assert ready["type"] == "ready" and len(ready["ranks"]) == 2
        workers = []
        for r in ready["ranks"]:
            workers += ["--worker", f"sim:{r['rank']}={r['endpoint']},{r['replay_endpoint']}"]
        with cli("listen", *workers, "--json", "--count", "30") as listen:
            assert listen.wait() == 0
            out = records(listen.rest())
        pub.popen.send_signal(signal.SIGTERM)
        assert pub.wait() == 0
        summary = json.loads(pub.rest()[-1])
    for rank in (0, 1):
        seqs = [r["seq"] for r in out if r["type"] == "batch" and r["rank"] == rank]
        assert seqs == list(range(len(seqs)))
    assert sum(r["type"] == "batch" for r in out) == 30
    assert summary["type"] == "summary" and summary["batches"] >= 1
    assert all(r["dropped"] == 0 for r in summary["ranks"])


def test_publish_stops_after_count_with_a_summary() -> None:
    """publish --count stops by itself and prints its summary lines."""
    with cli("publish", "--endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "none",
             "--count", "5", "--rate", "500") as proc:  # fmt: skip
        assert proc.wait() == 0
        lines = proc.rest()
    assert lines[0].startswith("rank 0: publishing on tcp://127.0.0.1:")
    assert lines[1].startswith("published 5 batches from ")
    assert lines[2].startswith("  rank 0: 5 sent, 0 dropped")


# ---------------------------------------------------------------------- help and errors


@pytest.mark.parametrize("command", ["listen", "replay", "publish", "bench"])
def test_every_command_has_help_with_examples(command: str) -> None:
    """`kvevents COMMAND --help` exits 0 and shows examples."""
    with cli(command, "--help") as proc:
        assert proc.wait() == 0
        text = "\n".join(proc.rest())
    assert "examples:" in text and f"kvevents {command}" in text


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["listen"], 2, "no stream to read"),
        (["listen", "tcp://*:5557"], 2, "not '*'"),
        (["listen", "--worker", "x:y=tcp://127.0.0.1:5557"], 2, "rank 'y' is not a number"),
        (["listen", "--worker", "x:²=tcp://127.0.0.1:5557"], 2, "rank '²' is not a number"),
        (["listen", "tcp://127.0.0.1:5557", "--count", "0"], 2, "is not an integer >= 1"),
        (["replay", "tcp://127.0.0.1:5600"], 2, "--from"),
        (["replay", "tcp://127.0.0.1:5600", "--from", "5", "--to", "2"], 2, "before --from 5"),
        (["publish", "--endpoint", "nope"], 2, "scheme must be one of"),
        (["publish", "--rate", "-1"], 2, "is not a number > 0"),
        (["bench", "--dir", "/nonexistent"], 1, "no bench/run.py found"),
        (["nosuch"], 2, "invalid choice"),
    ],
)
def test_bad_arguments_give_one_line(args: list[str], status: int, message: str) -> None:
    """A bad command line is one clear error line on stderr and a non-zero exit."""
    with cli(*args) as proc:
        assert proc.wait() == status
        proc.rest()
    err = "".join(proc.err).strip()
    assert "\n" not in err and message in err and err.startswith("kvevents")


# ---------------------------------------------------------------------- serve


def test_serve_indexes_a_published_worker_and_serves_metrics() -> None:
    """serve indexes what publish sends and /metrics has index and per-stream subscriber metrics."""
    import httpx

    with cli("publish", "--endpoint", "tcp://127.0.0.1:0", "--replay-endpoint",
             "tcp://127.0.0.1:0", "--rate", "200", "--json") as pub:  # fmt: skip
        rank = json.loads(pub.line() or "{}")["ranks"][0]
        worker = f"sim={rank['endpoint']},{rank['replay_endpoint']}"
        with cli("serve", "--port", "0", "--worker", worker) as serve:
            url = (serve.line() or "").removeprefix("serving on ")
            assert url.startswith("http://127.0.0.1:")
            deadline = Deadline(TIMEOUT)
            while not (blocks := httpx.get(f"{url}/dump").json()["holders"]):
                assert not deadline.expired, "nothing indexed in time"
                time.sleep(0.02)
            text = httpx.get(f"{url}/metrics").text
            serve.popen.send_signal(signal.SIGTERM)
            assert serve.wait() == 0
    delivered = 'kvevents_subscriber_stream_delivered_total{rank="0",worker_id="sim"} '
    assert float(text.split(delivered)[1].split()[0]) >= 1
    assert "kvevents_index_blocks " in text
    assert "kvevents_subscriber_streams 1.0" in text
    assert blocks and blocks[0]["worker_id"] == "sim"


def test_bench_rejects_an_unknown_name_in_one_line() -> None:
    """``kvevents bench nope`` is a one-line usage error listing the benchmarks, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "bench", "nope"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown benchmark 'nope' (choose from " in done.stderr and "wire" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_during_bench_says_what_finished() -> None:
    """Ctrl-C (SIGINT to the whole process group) during a benchmark prints "interrupted" and
    what finished, records nothing, and exits 130 without a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "bench", "wire"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "== bench_wire"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 130
    assert "interrupted during bench_wire; finished: none; nothing recorded" in err
    assert "Traceback" not in err


def test_listen_that_receives_nothing_says_why_and_exits_3() -> None:
    """A listen run that saw no batch names the endpoint, lists the likely causes (nothing
    publishing, wrong endpoint or topic, idle engine, encryption) and exits 3, not 0."""
    with started_publisher() as pub:  # bound, but never publishes
        done = subprocess.run(
            [sys.executable, "-m", "kvevents.cli", "listen", "--plain", "--duration", "0.5",
             connectable(pub.endpoint)],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert f"nothing received in 0.5 s from {connectable(pub.endpoint)}; maybe:" in done.stderr
    for cause in ("kv events enabled", "--topic", "heartbeats", "--curve-server-key"):
        assert cause in done.stderr, cause


def test_publish_on_an_ephemeral_endpoint_puts_replay_next_to_it() -> None:
    """``publish --endpoint tcp://127.0.0.1:0`` alone binds replay on an ephemeral port of the
    same host, not on the default tcp://*:5600."""
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "publish", "--endpoint", "tcp://127.0.0.1:0",
         "--json", "--count", "1"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ready = json.loads(done.stdout.splitlines()[0])
    replay = ready["ranks"][0]["replay_endpoint"]
    assert replay.startswith("tcp://127.0.0.1:") and not replay.endswith(":5600")
