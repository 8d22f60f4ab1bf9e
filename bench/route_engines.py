"""The real engines of ``bench_route``: vLLM's OpenAI server on CPU, started once per run.

Each engine is :class:`kvevents.testing.vllm_server.VllmServer` (prefix caching,
``--enable-prompt-tokens-details``, KV events with replay on tcp, the empty topic,
``VLLM_SERVER_DEV_MODE=1``), plus what the rig needs: a kill (SIGKILL to its process group, as
a crash) and a restart on the same ports (routers keep the worker URL and event endpoints they
were given). An :class:`EventWatch` keeps a SUB socket on every engine's event stream for the
whole run: a cache reset is complete only when the engine has *published* its
``AllBlocksCleared`` (vLLM publishes it with the next engine step, so the reset is followed by
a one-token request until the clear arrives).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvevents.deadline import Deadline
from kvevents.events import AllBlocksCleared
from kvevents.testing.vllm_server import VllmServer, VllmServerError, start_servers
from kvevents.wire import decode_batch

MODEL_NAME = "chat"
RESET_TIMEOUT = 30.0
#: The nice value a relaunched engine starts at when boosted (see :meth:`BenchEngine.relaunch`).
START_BOOST = -10


class BenchEngine(VllmServer):
    """A :class:`VllmServer` restarted on the ports it had (routers keep the URL and event
    endpoints they were given); ``kill()`` is the server's own (SIGKILL to its group)."""

    def relaunch(self, *, boost: bool = False) -> BenchEngine:
        """Start again on the same HTTP and event ports; return at once (``wait_ready`` waits).

        ``boost``: it starts at nice :data:`START_BOOST` until :meth:`settle`. On the rig's
        two saturated cores a relaunched engine's worker (bound to the core the other engines
        compute on) got about 3% of it and did not start until the traffic ended (4 min 22 s,
        against 12 s idle); boosted, it starts as on a machine with room for it, and serves
        at the others' priority once it is back. The engine runs in a session of its own, so
        where the kernel groups sessions (``sched_autogroup``) the nice value that counts is
        its group's (``/proc/PID/autogroup``; a process's own nice only orders it within its
        group: set alone, it changed nothing here); both are set. Lowering a nice value takes
        root or CAP_SYS_NICE: without them the start is not boosted."""
        self.launch(same_ports=True)
        if boost and self._proc is not None:
            _renice(self._proc.pid, START_BOOST)
        return self

    def settle(self) -> None:
        """The engine back at nice 0, as the other engines run."""
        if self._proc is not None:
            _renice(self._proc.pid, 0)


def _renice(leader: int, nice: int) -> None:
    """``nice`` for the session ``leader`` started (its process group and, where sessions are
    scheduled as groups, the group's own nice)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, leader, nice)  # started in a new session: pgid == pid
    with contextlib.suppress(OSError):
        Path(f"/proc/{leader}/autogroup").write_text(f"{nice}\n")


@dataclass
class Snapshot:
    """An engine's counters from its /metrics (cumulative since it started): prefix-cache
    queries and hits (tokens), finished requests, prompt tokens, and the time its finished
    requests spent in each phase inside the engine (vLLM's histograms: waiting to be
    scheduled, scheduled to first token, first token to last; their sums in seconds, and the
    requests and generated tokens they cover)."""

    queries: float = 0.0
    hits: float = 0.0
    requests: float = 0.0
    prompt_tokens: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    phased: float = 0.0  # requests in the phase histograms
    output_tokens: float = 0.0

    def __sub__(self, other: Snapshot) -> Snapshot:
        return Snapshot(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __add__(self, other: Snapshot) -> Snapshot:
        return Snapshot(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


#: Snapshot's fields, in order, as vLLM's /metrics names them (summed over their labels).
SNAPSHOT_METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_count",
    "vllm:generation_tokens_total",
)


def engine_phases(deltas: Sequence[Snapshot]) -> list[dict[str, float]]:
    """Each engine's phase sums over a run (``summary.json``'s ``engine_phases``, what
    :func:`route_sim.loaded_timing` reads)."""
    return [
        {
            "requests": d.phased,
            "output_tokens": d.output_tokens,
            "queue_s": round(d.queue_s, 3),
            "prefill_s": round(d.prefill_s, 3),
            "decode_s": round(d.decode_s, 3),
        }
        for d in deltas
    ]


def snapshot(engine: VllmServer) -> Snapshot:
    """The engine's counters now (:class:`Snapshot`)."""
    values = engine.metrics()
    return Snapshot(*(values.get(name, 0.0) for name in SNAPSHOT_METRICS))


class EventWatch(threading.Thread):
    """Counts each engine's published ``AllBlocksCleared`` and batches, for the whole run."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(name="bench-route-events", daemon=True)
        self._context: zmq.Context[Any] = zmq.Context()
        self._sockets = []
        for endpoint in endpoints:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._sockets.append(sub)
        self.cleared = [0] * len(endpoints)
        self.batches = [0] * len(endpoints)
        self.undecodable = [0] * len(endpoints)
        self._halt = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for sub in self._sockets:
            poller.register(sub, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                for sub, _ in poller.poll(100):
                    self._receive(self._sockets.index(sub), sub.recv_multipart())
        finally:
            for sub in self._sockets:
                sub.close(0)
            self._context.term()

    def _receive(self, index: int, frames: list[bytes]) -> None:
        self.batches[index] += 1
        try:
            batch = decode_batch(frames[-1]).batch
        except Exception:  # counted: one bad frame must not stop the watch
            self.undecodable[index] += 1
            return
        self.cleared[index] += sum(isinstance(e, AllBlocksCleared) for e in batch.events)

    def close(self) -> None:
        self._halt.set()
        self.join(5)


def _port_taken(engine: BenchEngine) -> bool:
    try:
        return "Address already in use" in engine.log_path.read_text(errors="replace")
    except OSError:
        return False


@dataclass
class Cluster:
    """``engines`` serving the router runs, and ``pooled``: one engine with all their cache."""

    engines: list[BenchEngine]
    pooled: BenchEngine | None
    watch: EventWatch = field(init=False)

    @property
    def all(self) -> list[BenchEngine]:
        return [*self.engines, *([self.pooled] if self.pooled else [])]

    def start(self, attempts: int = 3) -> Cluster:
        """Every engine up; an engine whose free port another process took meanwhile (the
        machine is shared: "Address already in use" in its log) is started again on new ones."""
        for attempt in range(attempts):
            try:
                start_servers(self.all)
                break
            except VllmServerError:
                if attempt == attempts - 1 or not any(_port_taken(e) for e in self.all):
                    raise
        self.watch = EventWatch([engine.event_endpoint() for engine in self.all])
        self.watch.start()
        return self

    def stop(self) -> None:
        """Every engine stopped, then the event watch closed."""
        try:
            for engine in self.all:
                engine.stop()
        finally:
            if getattr(self, "watch", None) is not None:
                self.watch.close()

    def snapshots(self, engines: Sequence[BenchEngine]) -> list[Snapshot]:
        return [snapshot(engine) for engine in engines]

    def reset(self, engines: Sequence[BenchEngine]) -> float:
        """Empty each engine's prefix cache and wait for its published clear; seconds taken."""
        began = time.monotonic()
        for engine in engines:
            self._reset_one(engine)
        return time.monotonic() - began

    def _reset_one(self, engine: BenchEngine) -> None:
        index = self.all.index(engine)
        before = self.watch.cleared[index]
        engine.reset_prefix_cache()
        deadline = Deadline(RESET_TIMEOUT)
        while self.watch.cleared[index] == before:
            if deadline.expired:
                raise VllmServerError(f"engine {engine.url}: no AllBlocksCleared published")
            # The clear is published with the next engine step: give it one (no full block).
            engine.post_json(
                "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
            )
            time.sleep(0.2)


def make_cluster(
    python: str,
    model_dir: Path,
    *,
    count: int,
    block_size: int,
    blocks: int,
    pooled: bool,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    log_dir: Path,
) -> Cluster:
    """``count`` engines of ``blocks`` blocks, and the pooled one of ``count * blocks``."""

    def engine(num_blocks: int) -> BenchEngine:
        return BenchEngine(
            python,
            model_dir,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            served_model_name=MODEL_NAME,
            log_dir=log_dir,
            # --enable-scale-out only registers the render endpoints (/v1/chat/completions/
            # render ...) that vLLM Router's kv_aware and cache_aware ask every worker for;
            # without it they answer 403 and that router routes on load alone.
            extra_args=(
                "--enable-scale-out",
                *("--max-num-seqs", str(max_num_seqs)),
                *("--max-num-batched-tokens", str(max_num_batched_tokens)),
            ),
        )

    engines = [engine(blocks) for _ in range(count)]
    return Cluster(engines, engine(count * blocks) if pooled else None)


def describe(cluster: Cluster) -> dict[str, Any]:
    """What each engine ran with, for the run's record."""
    return {
        engine.url: {
            "blocks": engine.num_blocks,
            "block_size": engine.block_size,
            "max_model_len": engine.context_len,
            "events": engine.event_endpoint(),
            "replay": engine.replay_endpoint(),
            "startup_s": round(engine.startup, 1),
            "command": json.dumps([_in_repo(arg) for arg in engine.command()]),
        }
        for engine in cluster.all
    }


#: The checkout this file is in: the record names paths inside it relative to it, so it reads
#: the same on any machine.
REPO = Path(__file__).resolve().parent.parent


def _in_repo(arg: str) -> str:
    """``arg``, relative to the checkout when it is an absolute path inside it."""
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(REPO):
        return str(path.relative_to(REPO))
    return arg
