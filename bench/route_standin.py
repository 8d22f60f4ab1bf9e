"""A stand-in for ``kvevents route`` until it lands: ``kvevents serve``'s decision behind a thin
proxy (bench only; not the front door, and not measured as one).

``python bench/route_standin.py --port P --model-dir DIR --policy NAME --engine ID=URL,EVENTS,REPLAY
...`` starts ``kvevents serve`` (a child process, the engines' event streams registered as
workers) and answers ``POST /v1/chat/completions``: it renders the messages with the model's
chat template (as vLLM does: :class:`route_sim.Renderer`), asks ``POST /query`` for the winner
under ``--policy``, forwards the client's bytes to that engine and streams the answer back.
The load the policy weighs is the proxy's own, reported to ``/load`` at every change: per
engine, the prompt blocks not matched at the decision of requests in flight (queued) and
their prompt blocks (active), until each ends. ``GET /health`` and ``/v1/models`` are the
first engine's.

It exists so that the rig's simulator comparison has real figures for the index's policies
now (bench_route runs it in the ``kvevents route`` slot while that is unavailable); it retries
nothing, tokenizes on the event loop, and is no measure of the front door's overhead.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK_SIZE = 32


@dataclass
class Engine:
    worker_id: str
    url: str
    events: str
    replay: str
    queued: int = 0
    active: int = 0


class StandIn:
    """The proxy: a decision per request from the index service, its own load accounting."""

    def __init__(self, engines: list[Engine], service: str, policy: str, model_dir: Path) -> None:
        from route_sim import Renderer

        self.engines = {e.worker_id: e for e in engines}
        self.service = service
        self.policy = policy
        self.renderer = Renderer(model_dir)
        self.session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=5))

    async def close(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _report(self) -> None:
        loads = [
            {
                "worker_id": e.worker_id,
                "rank": 0,
                "queued_blocks": e.queued,
                "active_blocks": e.active,
            }
            for e in self.engines.values()
        ]
        assert self.session is not None
        async with self.session.post(f"{self.service}/load", json={"loads": loads}) as reply:
            await reply.read()

    async def _decide(self, tokens: list[int]) -> tuple[Engine, int]:
        assert self.session is not None
        query = {"token_ids": tokens, "policy": self.policy}
        async with self.session.post(f"{self.service}/query", json=query) as reply:
            answer = await reply.json()
        decision = answer["decision"]
        winner = decision["winner"]["worker_id"]
        matched = next(s["matched_blocks"] for s in decision["scores"] if s["worker_id"] == winner)
        return self.engines[winner], matched

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        tokens = self.renderer.tokens(json.loads(body)["messages"])
        engine, matched = await self._decide(tokens)
        blocks = math.ceil(len(tokens) / BLOCK_SIZE)
        new = max(0, blocks - matched)
        engine.queued += new
        engine.active += blocks
        await self._report()
        try:
            return await self._forward(request, engine, body)
        finally:
            engine.queued -= new
            engine.active -= blocks
            await self._report()

    async def _forward(
        self, request: web.Request, engine: Engine, body: bytes
    ) -> web.StreamResponse:
        assert self.session is not None
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.session.post(
            f"{engine.url}{request.path}", data=body, headers=headers
        ) as up:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            response.headers["x-kvevents-engine"] = engine.worker_id
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def passthrough(self, request: web.Request) -> web.Response:
        assert self.session is not None
        first = next(iter(self.engines.values()))
        async with self.session.get(f"{first.url}{request.path}") as up:
            return web.Response(
                status=up.status, body=await up.read(), content_type=up.content_type
            )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_service(engines: list[Engine]) -> tuple[subprocess.Popen[bytes], str]:
    """``kvevents serve`` with every engine's streams as a worker; its URL once it answers."""
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "kvevents.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for e in engines:
        argv += ["--worker", f"{e.worker_id}={e.events},{e.replay}"]
    argv += ["--block-size", str(BLOCK_SIZE)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"kvevents serve exited ({proc.returncode})") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvevents serve did not start in 60 s")


def _engine(spec: str, n: int) -> Engine:
    url, events, replay = spec.split(",")
    return Engine(f"e{n}", url, events, replay)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--engine", action="append", required=True, help="URL,EVENTS,REPLAY")
    args = parser.parse_args(argv)
    engines = [_engine(spec, n) for n, spec in enumerate(args.engine)]
    service, url = start_service(engines)
    try:
        standin = StandIn(engines, url, args.policy, args.model_dir)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_startup.append(standin.start)
        app.on_cleanup.append(standin.close)
        app.router.add_post("/v1/chat/completions", standin.chat)
        app.router.add_get("/health", standin.passthrough)
        app.router.add_get("/v1/models", standin.passthrough)
        web.run_app(app, host="127.0.0.1", port=args.port, print=None, handle_signals=True)
    finally:
        service.terminate()
        service.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
