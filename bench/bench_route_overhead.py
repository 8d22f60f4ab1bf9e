"""The front door's own cost: time to first token added in front of a fast stand-in engine,
and requests per second at saturation with 1, 16 and 128 concurrent streams, next to the peer
routers in front of the same engine in the same run.

Same-run baseline: the same client straight to the same engine. The engine
(:class:`kvevents.testing.openai_engine.StandInEngine`, this file with ``--serve-engine``) and
each router run in their own process; the client is this process, an asyncio client on raw
sockets that stamps the first SSE event of each answer. ``kvevents route`` is the real front
door (``python -m kvevents route``): each request's chat rendered and tokenized with the
model's own tokenizer and template (the tiny chat model's, built here), looked up in the index
and planned; the engine has no event stream, so every request is routed on load. The engine
answers vLLM's render endpoints as ``vllm serve --enable-scale-out`` does (``render=True``:
the prompt's token ids, one per 4 bytes of its messages). The peers run from the venvs the
route rig installs (``bench/.work/route/venvs``; installed here when missing; reported, not
dropped, when they cannot be): vLLM Router ``round_robin`` (a proxy and nothing more),
``cache_aware`` (per request: a ``POST /v1/chat/completions/render`` to the engine for the
prompt's token ids, then its prefix tree of those ids matched and updated) and ``kv_aware``
(the same render call, then the ids hashed into blocks of 16 and looked up in its index of
the engine's KV events; it subscribes to a port where nothing publishes, so the index stays
empty and every lookup misses), and SGLang's router ``cache_aware`` (its tree of the
request's text). ``--router NAME=URL`` adds any other router already in front of the engine
on ``--engine-port``.

Every answer is checked (status 200, ``data: [DONE]`` seen): a lost or failed request is
counted and reported, never dropped from the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, percentile
from kvevents.testing.vllm_server import free_port
from route_peers import SGLANG_ROUTER, VLLM_ROUTER, RouterProcess, Venv

SECTION = "front door overhead in front of a stand-in engine (streamed chat, 8 tokens)"
MODEL = "stand-in"
BODY = (
    b'{"model":"stand-in","messages":[{"role":"system","content":"You are a helpful assistant '
    b'who answers in short sentences."},{"role":"user","content":"Say hello to the router, '
    b'then count to three."}],"stream":true,"max_tokens":8}'
)
HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"

CONCURRENCY = (1, 16, 128)
# Issue #24's goal, against vLLM Router measured in the same run.
TARGET = "added p50 <= vLLM Router's (same run)"


@dataclass
class Tally:
    """What one client run got: TTFT samples (s), answers completed and lost."""

    ttft: list[float] = field(default_factory=list)
    done: int = 0
    lost: int = 0


def _request(url: str) -> bytes:
    host = urlsplit(url).netloc
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes) -> float:
    """One streamed request on a kept-alive connection: seconds to its first SSE event
    (ValueError: not a 200 that ended with [DONE])."""
    began = time.perf_counter()
    writer.write(raw)
    first: float | None = None
    head, tail, done = b"", b"", False
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise ValueError("the connection closed mid-answer")
        if first is None and b"data:" in data:
            first = time.perf_counter()
        if len(head) < 12:
            head += data[:12]
        seen = tail + data
        done = done or b"[DONE]" in seen
        tail = seen[-16:]
        if tail.endswith(b"\r\n0\r\n\r\n"):
            break
    if not head.startswith(b"HTTP/1.1 200") or not done or first is None:
        raise ValueError(f"not a complete stream: {head!r}")
    return first - began


async def _stream(url: str, until: float, tally: Tally) -> None:
    parts = urlsplit(url)
    raw = _request(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        while time.perf_counter() < until:
            try:
                tally.ttft.append(await _one(reader, writer, raw))
                tally.done += 1
            except (ValueError, ConnectionError):
                tally.lost += 1
                writer.close()
                reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    finally:
        writer.close()


async def _load(url: str, streams: int, seconds: float) -> Tally:
    tally = Tally()
    until = time.perf_counter() + seconds
    await asyncio.gather(*(_stream(url, until, tally) for _ in range(streams)))
    return tally


@dataclass(frozen=True)
class Load:
    """One load run: its tally, requests per second, and the router's CPU seconds in it."""

    tally: Tally
    rate: float
    cpu_s: float | None = None


def measure(url: str, streams: int, seconds: float, pid: int | None = None) -> Load:
    """``streams`` concurrent streams for ``seconds`` (the CPU of process ``pid`` timed)."""
    import uvloop

    cpu = None if pid is None else _cpu_seconds(pid)
    began = time.perf_counter()
    tally = uvloop.run(_load(url, streams, seconds))
    rate = tally.done / (time.perf_counter() - began)
    return Load(tally, rate, None if pid is None or cpu is None else _cpu_seconds(pid) - cpu)


# ---------------------------------------------------------------------- the processes


def _child(args: Sequence[str]) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line.startswith("http://"):
        child.kill()
        raise RuntimeError(f"{' '.join(args)} did not start: {line!r}")
    return child, line


def _serve_engine(port: int) -> None:
    from kvevents.testing.openai_engine import Behaviour, StandInEngine

    behaviour = Behaviour(tokens=8)
    engine = StandInEngine(models=(MODEL,), port=port, behaviour=behaviour, render=True).start()
    print(engine.url, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    engine.close()


def _kvevents_route(engine_url: str) -> RouterProcess:
    """``kvevents route`` in front of the engine, with the tiny chat model's tokenizer."""
    from kvevents.testing.chat_model import build_tokenizer

    tokenizer = build_tokenizer(WORK / "chat-tokenizer")
    port = free_port()
    argv = [sys.executable, "-m", "kvevents.cli", "route", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--engine", f"e0={engine_url}"]
    argv += ["--tokenizer", f"{MODEL}={tokenizer}", "--block-size", "16"]
    return RouterProcess(argv, _log("kvevents-route"), port, 0)


def _vllm_router(engine_url: str, policy: str) -> RouterProcess | str:
    """vLLM Router with ``policy`` in front of the engine (from the venv the route rig
    installs, installed here when missing), or why it cannot run."""
    venv = Venv("vllm-router", VLLM_ROUTER, WORK / "route" / "venvs")
    why = venv.ensure()
    if why is not None:
        return why
    port, metrics = free_port(), free_port()
    argv = [str(venv.bin("vllm-router")), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", policy, "--worker-urls", engine_url]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    if policy == "kv_aware":  # as the route rig runs it, its events from a silent port
        events = f"tcp://127.0.0.1:{free_port()}"
        argv += ["--kv-event-source", f"{engine_url}={events}", "--kv-event-model", MODEL]
        argv += ["--kv-event-block-size", "16"]
    return RouterProcess(argv, _log(f"vllm-router-{policy}"), port, metrics)


def _sglang_router(engine_url: str) -> RouterProcess | str:
    """SGLang's router ``cache_aware`` in front of the engine, or why it cannot run."""
    venv = Venv("sglang-router", SGLANG_ROUTER, WORK / "route" / "venvs")
    why = venv.ensure()
    if why is not None:
        return why
    port, metrics = free_port(), free_port()
    argv = [str(venv.bin("smg")), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", "cache_aware", "--worker-urls", engine_url]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    return RouterProcess(argv, _log("sglang-router"), port, metrics)


def _log(name: str) -> Path:
    """Where a router's output goes (its tail is in the error if it does not start)."""
    directory = WORK / "route-overhead"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{name}.log"


# ---------------------------------------------------------------------- the run


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _latency_rows(name: str, routed: Tally, direct: Tally) -> list[Row]:
    rows = []
    for q in (50, 99):
        mine, base = percentile(routed.ttft, q), percentile(direct.ttft, q)
        rows.append(
            Row(SECTION, f"{name}, 1 stream", f"TTFT p{q}", _ms(mine), "ms", _ms(base), "direct")
        )
        target = TARGET if q == 50 else ""
        rows.append(
            Row(
                SECTION,
                f"{name}, 1 stream",
                f"added TTFT p{q}",
                _ms(mine - base),
                "ms",
                target=target,
            )
        )
    return rows


def _rate_rows(
    name: str, streams: int, routed: Load, direct: Load, cpu_us: float | None
) -> list[Row]:
    case = f"{name}, {streams} stream{'s' if streams > 1 else ''}"
    p50, base50 = percentile(routed.tally.ttft, 50), percentile(direct.tally.ttft, 50)
    lost, base_lost = routed.tally.lost, direct.tally.lost
    rows = [
        Row(SECTION, case, "requests/s", routed.rate, "/s", direct.rate, "direct"),
        Row(SECTION, case, "TTFT p50", _ms(p50), "ms", _ms(base50), "direct"),
        Row(SECTION, case, "requests lost", lost, "", base_lost, "direct", "0"),
    ]
    if cpu_us is not None:
        rows.append(Row(SECTION, case, "router CPU per request", cpu_us, "us"))
    return rows


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_all(
    engine: str,
    routers: dict[str, str],
    pids: dict[str, int],
    latency_s: float,
    load_s: float,
) -> list[Row]:
    measure(engine, 1, 0.5)  # warm every path up: connections, caches, imports
    for url in routers.values():
        measure(url, 1, 0.5)
    rows: list[Row] = []
    # Latency: direct and each router in alternating rounds, so drift hits all alike.
    direct, routed = Tally(), {name: Tally() for name in routers}
    for _ in range(4):
        _merge(direct, measure(engine, 1, latency_s / 4).tally)
        for name, url in routers.items():
            _merge(routed[name], measure(url, 1, latency_s / 4).tally)
    for name in routers:
        rows += _latency_rows(name, routed[name], direct)
    for streams in CONCURRENCY:
        base = measure(engine, streams, load_s)
        for name, url in routers.items():
            load = measure(url, streams, load_s, pids.get(name))
            cpu = None if load.cpu_s is None else load.cpu_s / max(1, load.tally.done) * 1e6
            rows += _rate_rows(name, streams, load, base, cpu)
    return rows


def _merge(into: Tally, more: Tally) -> None:
    into.ttft += more.ttft
    into.done += more.done
    into.lost += more.lost


def run(
    routers: dict[str, str] | None = None,
    engine_port: int = 0,
    latency_s: float = 4.0,
    load_s: float = 3.0,
) -> list[Row]:
    """The figures: kvevents route and vLLM Router (started here) and ``routers`` (name ->
    URL, already in front of the engine on ``engine_port``) against the engine directly."""
    engine, engine_url = _child(["--serve-engine", str(engine_port)])
    started: dict[str, RouterProcess] = {}
    rows: list[Row] = []
    try:
        started["kvevents route"] = _kvevents_route(engine_url)
        peers = {
            "vLLM Router round_robin": lambda: _vllm_router(engine_url, "round_robin"),
            "vLLM Router cache_aware": lambda: _vllm_router(engine_url, "cache_aware"),
            "vLLM Router kv_aware": lambda: _vllm_router(engine_url, "kv_aware"),
            "SGLang router cache_aware": lambda: _sglang_router(engine_url),
        }
        for name, start in peers.items():
            peer = start()
            if isinstance(peer, str):
                rows.append(Row(SECTION, name, f"not run: {peer}", 0, ""))
            else:
                started[name] = peer
        for router in started.values():
            router.wait_ready()
        everyone = {name: r.url for name, r in started.items()} | (routers or {})
        pids = {name: r.pid for name, r in started.items()}
        return rows + _run_all(engine_url, everyone, pids, latency_s, load_s)
    finally:
        for router in started.values():
            router.stop()
        engine.communicate(timeout=10)  # closes its stdin: it stops


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--engine-port", type=int, default=0)
    parser.add_argument("--latency-seconds", type=float, default=4.0)
    parser.add_argument("--load-seconds", type=float, default=3.0)
    parser.add_argument("--serve-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_engine is not None:
        _serve_engine(args.serve_engine)
        return 0
    routers = dict(r.split("=", 1) for r in args.router)
    rows = run(routers, args.engine_port, args.latency_seconds, args.load_seconds)
    from run import render

    print(render(rows, ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
