"""serve --state-file: registrations made over HTTP survive a restart; a bad file is an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.state import StateFile, StateFileError
from kvevents.testing.feeds import FakeFeed
from kvevents.testing.sockets import Deadline

A = WorkerRegistration("a", "tcp://127.0.0.1:5557", 16, (0, 1), "tcp://127.0.0.1:5600", "t", "m")
B = WorkerRegistration("b", "tcp://127.0.0.1:5567", 32)


def service_with(state: StateFile) -> IndexService:
    return IndexService(PrefixIndex(), feed=FakeFeed(), state=state)


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
