"""What serve is given at start: its settings, state and token files (bounded reads, a warning
for a token others may read) and its listening address (a token, or an explicit flag, off
loopback)."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvevents.cli.common import UsageError
from kvevents.cli.config import ServeSettings, resolve
from kvevents.files import read_bounded
from kvevents.http import exposed_mode, is_loopback, load_token
from kvevents.service.state import StateFile, StateFileError
from kvevents.testing.sockets import Deadline

# A ceiling on the address space of serve in a subprocess: an unbounded read of /dev/zero
# reaches it in a second or two (MemoryError) instead of filling the machine's memory.
_ADDRESS_SPACE = 4 << 30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


def _environ(extra: dict[str, str]) -> dict[str, str]:
    """This environment without a token of its own, plus ``extra``."""
    own = {k: v for k, v in os.environ.items() if not k.startswith("KVEVENTS_")}
    return {**own, **extra, "PYTHONUNBUFFERED": "1"}


def serve_once(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvevents serve ARGS`` run to its end (these starts are refused), memory capped."""
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_environ({}),
        preexec_fn=_limited,
    )


@contextmanager
def started(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``kvevents serve ARGS`` until it says it serves; yields that line, then stops it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environ(env or {}),
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline()  # bounded by the test's timeout
    finally:
        proc.terminate()
        proc.communicate(timeout=Deadline(30.0).remaining())


# ------------------------------------------------------------------ bounded reads


def test_read_bounded_refuses_devices_directories_and_files_over_the_limit(
    tmp_path: Path,
) -> None:
    """A device or a directory is refused by its kind, a file one byte over the limit by its
    size; a file of exactly the limit and a pipe are read."""
    with pytest.raises(OSError, match="a character device, not a regular file"):
        read_bounded("/dev/zero", 100, "settings file")
    with pytest.raises(OSError, match="a directory, not a regular file"):
        read_bounded(tmp_path, 100, "settings file")
    path = tmp_path / "f"
    path.write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="over 100 bytes, the largest state file read"):
        read_bounded(path, 100, "state file")
    path.write_bytes(b"x" * 100)
    assert read_bounded(path, 100, "state file") == b"x" * 100
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf s3cret > {fifo}"])
    try:
        assert read_bounded(fifo, 100, "token file") == b"s3cret"
    finally:
        writer.wait(timeout=10)


@pytest.mark.parametrize(
    ("option", "status"), [("--config", 2), ("--state-file", 1), ("--auth-token-file", 2)]
)
def test_dev_zero_as_a_file_of_serve_is_one_error_line(option: str, status: int) -> None:
    """/dev/zero as the settings, state or token file stops serve at once with one line naming
    the option, the path and the rule (it used to be read until memory ran out)."""
    done = serve_once(option, "/dev/zero")
    assert done.returncode == status and done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line and "/dev/zero: a character device, not a regular file" in line


def test_oversized_and_undecodable_settings_files_are_refused(tmp_path: Path) -> None:
    """A settings file over 1 MiB, one that is not UTF-8 and one nested past the parser's
    depth are UsageErrors naming the file (not a traceback, not a read without end)."""
    cases = {
        "big.toml": (b"# " + b"x" * (1 << 20) + b"\n", "over 1048576 bytes"),
        "latin.toml": (b'[serve]\nhost = "\xff"\n', "not valid TOML: not UTF-8 text"),
        "deep.toml": (b"[serve]\nhost = " + b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    }
    for name, (content, rule) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UsageError) as caught:
            resolve(ServeSettings, "serve", argparse.Namespace(config=str(path)), {})
        assert str(path) in str(caught.value) and rule in str(caught.value)


def test_a_state_file_over_its_limit_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state file over MAX_STATE_BYTES is a StateFileError naming it and the limit."""
    monkeypatch.setattr("kvevents.service.state.MAX_STATE_BYTES", 64)
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "workers": []}' + " " * 64)
    with pytest.raises(StateFileError, match=rf"state file {path}: over 64 bytes"):
        StateFile(path).load()


def test_a_killed_writers_temporary_files_are_removed_at_the_next_start(tmp_path: Path) -> None:
    """Temporary files a kill -9 left beside the state file are removed at start; other
    files in the directory are not."""
    path = tmp_path / "state.json"
    StateFile(path).save([])
    stale = [tmp_path / ".state.json.k1l2d3.tmp", tmp_path / ".state.json.x9.tmp"]
    keep = [tmp_path / ".other.json.k1l2d3.tmp", tmp_path / "state.json.tmp"]
    for file in stale + keep:
        file.write_text("{")
    with started("--state-file", str(path)) as line:
        assert line.startswith("serving on ")
    assert sorted(os.listdir(tmp_path)) == sorted(["state.json", *(f.name for f in keep)])


# ------------------------------------------------------------------ the token file


def test_token_files_over_the_limit_or_not_text_are_refused(tmp_path: Path) -> None:
    """A token file over 4096 bytes or not UTF-8 is an error naming the file."""
    path = tmp_path / "token"
    path.write_text("t" * 4097)
    with pytest.raises(OSError, match="over 4096 bytes"):
        load_token(str(path), {})
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=f"{path}: the auth token is not UTF-8 text"):
        load_token(str(path), {})


def test_a_token_file_others_may_read_gets_a_warning(tmp_path: Path) -> None:
    """A token file readable by its group or by everyone is named with its mode and the fix;
    one only its owner reads is not (the start then fails later on, for another reason)."""
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    assert exposed_mode(str(path)) is None
    for mode in (0o640, 0o604):
        path.chmod(mode)
        assert exposed_mode(str(path)) == mode
    path.chmod(0o644)
    done = serve_once("--auth-token-file", str(path), "--state-file", str(tmp_path))
    assert done.returncode == 1
    warning = (
        f"kvevents serve: warning: --auth-token-file {path} may be read by others than its "
        f"owner (mode 0644): chmod 600 {path}"
    )
    assert done.stderr.splitlines()[0] == warning
    path.chmod(0o600)
    done = serve_once("--auth-token-file", str(path), "--state-file", str(tmp_path))
    assert done.returncode == 1 and "warning" not in done.stderr


# ------------------------------------------------------------------ the listening address


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("", False),
        ("myhost", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback_is_127_slash_8_ipv6_one_and_localhost(host: str, loopback: bool) -> None:
    """Only an address in 127.0.0.0/8, ::1 or the name localhost counts as loopback."""
    assert is_loopback(host) is loopback


def test_serve_off_loopback_without_a_token_refuses_to_start() -> None:
    """--host 0.0.0.0 with no token stops serve with one line saying why and what to give
    (it used to open /register to anyone who reaches the port)."""
    done = serve_once("--host", "0.0.0.0")
    assert done.returncode == 2 and done.stdout == ""
    line = done.stderr.strip()
    assert line.startswith("kvevents serve: error: --host 0.0.0.0 is not a loopback address")
    assert "--auth-token-file FILE or $KVEVENTS_AUTH_TOKEN" in line
    assert "--allow-unauthenticated" in line


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--allow-unauthenticated"], {}),
        ([], {"KVEVENTS_AUTH_TOKEN": "s3cret"}),
        ([], {"KVEVENTS_SERVE_ALLOW_UNAUTHENTICATED": "true"}),
    ],
    ids=["flag", "token", "setting"],
)
def test_serve_off_loopback_starts_with_a_token_or_the_explicit_flag(
    args: list[str], env: dict[str, str]
) -> None:
    """A token, or --allow-unauthenticated (flag or setting), lets serve listen off loopback."""
    with started("--host", "0.0.0.0", *args, env=env) as line:
        assert line.startswith("serving on http://0.0.0.0:")
