"""``kvevents route`` as a command: it starts, routes, stops cleanly, and says what is wrong."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvevents.testing.openai_engine import StandInEngine
from kvevents.testing.route import RouteProcess


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    with StandInEngine(("tiny",)).start() as started:
        yield started


def route(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "route", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_route_serves_the_openai_api_and_stops_on_sigterm(
    engine: StandInEngine, chat_model_tokenizer: Path
) -> None:
    """The command serves chats in front of an engine, says which engine answered, and exits
    0 on SIGTERM with a summary line."""
    args = ["--port", "0", "--tokenizer", str(chat_model_tokenizer), "--engine", f"a={engine.url}"]
    proc = RouteProcess(["route", *args]).start()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
        reply = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.headers["x-kvevents-engine"] == "a"
        assert httpx.get(f"{proc.url}/health").json()["status"] == "ok"
        assert "kvevents_route_planner_planned_total 1.0" in httpx.get(f"{proc.url}/metrics").text
    finally:
        status = proc.stop()
    assert status == 0
    assert "stopped: 1 requests planned" in proc.err


def test_route_says_each_engines_cache_at_start(chat_model_tokenizer: Path) -> None:
    """At start, one line per engine: up, its models, its cache size and where it came from
    (its /metrics, given with --engine-cache-blocks, or unknown)."""
    with (
        StandInEngine(("tiny",), num_gpu_blocks=501).start() as vllm_like,
        StandInEngine(("tiny",)).start() as silent,
        StandInEngine(("tiny",)).start() as given,
    ):
        # A loaded machine may miss the default 1 s at start: the lines would say "down".
        args = ["--port", "0", "--tokenizer", str(chat_model_tokenizer), "--health-timeout", "10"]
        args += ["--engine", f"a={vllm_like.url}", "--engine", f"b={silent.url}"]
        args += ["--engine", f"c={given.url}", "--engine-cache-blocks", "c=64"]
        proc = RouteProcess(["route", *args]).start()
        try:
            engines = httpx.get(f"{proc.url}/health").json()["engines"]
            assert [e["cache_blocks"] for e in engines] == [500, None, 64]
        finally:
            assert proc.stop() == 0
    assert "engine a: up; tiny; cache 500 blocks (from its /metrics)" in proc.out
    assert "engine b: up; tiny; cache size unknown (no cache bound)" in proc.out
    assert "engine c: up; tiny; cache 64 blocks (given)" in proc.out


def test_route_takes_its_settings_from_a_config_file_and_the_environment(
    engine: StandInEngine, chat_model_tokenizer: Path, tmp_path: Path
) -> None:
    """A [route] table sets the engines and tokenizer; $KVEVENTS_ROUTE_PORT beats the file's
    port (precedence as for serve)."""
    config = tmp_path / "route.toml"
    config.write_text(
        f'[route]\nport = 1\nengines = ["b={engine.url}"]\ntokenizers = ["{chat_model_tokenizer}"]\n'
    )
    proc = RouteProcess(["route", "--config", str(config)], env={"KVEVENTS_ROUTE_PORT": "0"})
    with proc:
        body = {"model": "tiny", "prompt": "hi"}
        reply = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=30)
        assert reply.headers["x-kvevents-engine"] == "b"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no engine: give at least one --engine URL"),
        (
            ["--engine", "http://127.0.0.1:1", "--kv-events", "x=tcp://127.0.0.1:5557"],
            "no --engine 'x' (NAME or URL)",
        ),
        (["--engine", "ftp://nowhere"], "expected [NAME=]http://HOST:PORT"),
        (
            ["--engine", "http://127.0.0.1:1", "--tokenizer", "/no/such/dir"],
            "--tokenizer /no/such/dir",
        ),
        (
            ["--engine", "http://127.0.0.1:1", "--dp-size", "http://127.0.0.1:1=0"],
            "expected 1..1024",
        ),
        (["--engine", "a=http://127.0.0.1:1", "--engine-block-size", "a=0"], "expected 1..1048576"),
        (
            ["--engine", "a=http://127.0.0.1:1", "--engine-cache-blocks", "a=lots"],
            "--engine-cache-blocks: 'lots' is not a number",
        ),
        (["--policy", "best"], "policy"),
    ],
)
def test_bad_settings_are_one_line_naming_the_flag(args: list[str], message: str) -> None:
    """Each mistake is a usage error (exit 2) whose one line names what is wrong."""
    done = route(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
