"""serve --state-file: registrations made over HTTP survive a restart; a bad file is an error."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvevents.http import serve
from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.state import StateFile, StateFileError
from kvevents.subscribe.streams import FeedHealth, Item, StreamSpec, StreamStats, SubscriberStats
from kvevents.testing.sockets import Deadline

A = WorkerRegistration("a", "tcp://127.0.0.1:5557", 16, (0, 1), "tcp://127.0.0.1:5600", "t", "m")
B = WorkerRegistration("b", "tcp://127.0.0.1:5567", 32)


class StillFeed:
    """A feed that accepts every stream and delivers nothing."""

    def add_stream(self, spec: StreamSpec) -> None:
        pass

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get(self, timeout: float | None = None) -> Item | None:
        return None

    def stats(self) -> SubscriberStats:
        return SubscriberStats(streams=0, incomplete=0, queued=0, callback_errors=0, max_lag=None)

    def stream_stats(self) -> dict[tuple[str, int], StreamStats]:
        return {}

    def health(self) -> FeedHealth:
        return FeedHealth("ok", True)


def service_with(state: StateFile) -> IndexService:
    return IndexService(PrefixIndex(), feed=StillFeed(), pushes=True, state=state)


def test_registrations_round_trip_through_the_file(tmp_path: Path) -> None:
    """What is saved is read back field for field; the temporary file does not linger."""
    state = StateFile(tmp_path / "state.json")
    assert state.load() == []  # a first start: no file yet
    state.save([A, B])
    assert state.load() == [A, B]
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1


def test_the_service_keeps_http_registrations_not_its_own(tmp_path: Path) -> None:
    """persist=True registrations (HTTP) are written at every change; the settings' are not."""
    state = StateFile(tmp_path / "state.json")
    service = service_with(state)
    service.register(A)
    service.register(B, persist=False)
    assert state.load() == [A]
    service.unregister("a", 1)
    assert [r.ranks for r in state.load()] == [(0,)]
    service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", 16), persist=False)
    assert state.load() == []  # the settings took worker a over
    assert service.stats().state_writes == 3


def test_a_failed_write_is_counted_and_the_registration_stands(tmp_path: Path) -> None:
    """A state file that cannot be written is logged and counted: the change is not undone."""
    state = StateFile(tmp_path / "gone" / "state.json")
    service = service_with(state)
    service.register(A)
    assert [r.worker_id for r in service.workers()] == ["a"]
    assert service.stats().state_write_errors == 1
    with pytest.raises(StateFileError, match=r"gone.*not writable"):
        state.check_writable()


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"version": 2, "workers": []}',
        b'{"version": 1, "workers": [{"worker_id": "a"}]}',
        b'{"version": 1, "workers": [], "extra": 1}',
        b'{"version": 1, "workers": [{"worker_id": "a", "endpoint": "tcp://h:1", '
        b'"block_size": 0, "ranks": [0]}]}',
    ],
)
def test_a_corrupt_state_file_is_an_error_naming_it(tmp_path: Path, content: bytes) -> None:
    """Not a state file: StateFileError naming the path and what to do, not a crash."""
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as caught:
        StateFile(path).load()
    assert str(path) in str(caught.value) and "remove it" in str(caught.value)


class Gate:
    """A restore's ``check`` that stops it before worker ``at`` until :meth:`open`."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, spec: StreamSpec) -> None:
        if spec.worker_id == self.at:
            self.reached.set()
            assert self._open.wait(10), "the test never opened the gate"

    def open(self) -> None:
        self._open.set()


def many_workers(n: int) -> list[WorkerRegistration]:
    return [WorkerRegistration(f"w{i}", f"tcp://127.0.0.1:{20000 + i}", 16) for i in range(n)]


def test_a_restore_writes_nothing_and_health_says_starting_until_it_ends(tmp_path: Path) -> None:
    """Restoring the file's workers never rewrites it (a kill half-way used to leave only those
    restored so far); /health is 503 "starting" with the progress until the restore ends."""
    path = tmp_path / "state.json"
    StateFile(path).save(many_workers(10))
    before = path.stat()
    service = service_with(StateFile(path))
    gate = Gate("w4")
    restoring = threading.Thread(target=service.restore, args=(StateFile(path).load(), gate))
    with serve(service=service) as server:
        restoring.start()
        assert gate.reached.wait(10)
        answer = httpx.get(f"{server.url}/health", timeout=10)
        assert answer.status_code == 503
        assert answer.json()["status"] == "starting"
        assert "4 of 10 workers registered" in answer.json()["error"]
        gate.open()
        restoring.join(10)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert len(service.workers()) == 10 and service.stats().state_writes == 0


def test_a_change_during_the_restore_is_written_once_at_its_end(tmp_path: Path) -> None:
    """An HTTP registration made while the restore runs is held, then written once with every
    restored worker; it wins over the file's registration of the same worker."""
    path = tmp_path / "state.json"
    StateFile(path).save(many_workers(10))
    service = service_with(StateFile(path))
    gate = Gate("w3")
    restoring = threading.Thread(target=service.restore, args=(StateFile(path).load(), gate))
    restoring.start()
    assert gate.reached.wait(10)
    newer = WorkerRegistration("w7", "tcp://127.0.0.1:30007", 32)
    service.register(newer)
    assert StateFile(path).load() == many_workers(10)  # not written half-way
    gate.open()
    restoring.join(10)
    saved = {reg.worker_id: reg for reg in StateFile(path).load()}
    assert len(saved) == 10 and saved["w7"] == newer
    assert newer in service.workers() and service.stats().state_writes == 1


class Serve:
    """``kvevents serve`` in a subprocess; its URL from the line it prints when ready."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvevents.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def url(self) -> str:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()  # bounded by the test's timeout
        assert line.startswith("serving on "), self.stop()[1]
        return line.removeprefix("serving on ").strip()

    def stop(self) -> tuple[int, str]:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        _, err = self.popen.communicate(timeout=Deadline(30.0).remaining())
        return self.popen.returncode, err


@contextmanager
def serving(*args: str) -> Iterator[tuple[Serve, str]]:
    proc = Serve(*args)
    try:
        yield proc, proc.url()
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(timeout=10)


def test_registrations_survive_a_restart_of_serve(tmp_path: Path) -> None:
    """End to end: register over HTTP, stop serve, start it again: the worker is back."""
    config = tmp_path / "serve.toml"
    config.write_text('[serve]\nstate_file = "state.json"\n')  # next to the config file
    body = {"worker_id": "w", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16, "ranks": 2}
    with serving("--config", str(config)) as (proc, url):
        assert httpx.post(f"{url}/register", json=body, timeout=10).status_code == 200
        assert proc.stop()[0] == 0
    assert [r.worker_id for r in StateFile(tmp_path / "state.json").load()] == ["w"]
    with serving("--config", str(config)) as (proc, url):
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert [(w["worker_id"], [r["rank"] for r in w["ranks"]]) for w in workers] == [
            ("w", [0, 1])
        ]
        proc.stop()


def test_serve_refuses_to_start_on_a_corrupt_state_file(tmp_path: Path) -> None:
    """A corrupt file stops serve at start with one line naming it (exit status 1)."""
    path = tmp_path / "state.json"
    path.write_text("{oops")
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "serve", "--port", "0", "--state-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"kvevents serve: error: state file {path}: not a kvevents")


def test_a_saved_worker_the_allow_list_now_refuses_is_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    """Restored workers pass today's endpoint policy, as over HTTP; a refused one is skipped."""
    path = tmp_path / "state.json"
    far = WorkerRegistration("far", "tcp://10.1.2.3:5557", 16)
    StateFile(path).save([far, B])
    with serving("--state-file", str(path)) as (proc, url):
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert [w["worker_id"] for w in workers] == ["b"]
        status, err = proc.stop()
    assert status == 0
    assert "warning: state file: worker 'far' not restored" in err


def _started_in(path: Path) -> float:
    """Seconds ``kvevents serve --state-file path`` takes to say it serves."""
    began = time.monotonic()
    with serving("--state-file", str(path)) as (proc, _):
        took = time.monotonic() - began
        proc.stop()
    return took


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_state_file_survives_a_kill_at_random_points_of_the_start(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """serve killed (or stopped) at random moments of its start, restore included, leaves the
    state file holding every one of its 1,000 workers, and no temporary file."""
    path = tmp_path / "state.json"
    workers = many_workers(1000)
    StateFile(path).save(workers)
    window = _started_in(path)
    seed = random.randrange(1 << 32)
    moments = sorted(random.Random(seed).uniform(0.1, window) for _ in range(3))
    for moment in moments:
        proc = Serve("--state-file", str(path))
        time.sleep(moment)
        proc.popen.send_signal(sig)
        proc.popen.communicate(timeout=30)
        assert StateFile(path).load() == workers, f"killed at {moment:.2f}s (seed {seed})"
        assert os.listdir(tmp_path) == ["state.json"]
