"""The real vLLM engine as a test peer, and the consumers that predict its prefix-cache hits.

``VllmEngine`` runs ``vllm_engine.py`` with vLLM's own interpreter (``.venv-vllm``, found like
Dynamo's: ``$KVEVENTS_VLLM_PYTHON``, then ``.venv-vllm/bin/python`` in the working directory
or a parent) and speaks its JSON-lines protocol. ``IndexFollower`` (our ``Subscriber`` feeding
a ``PrefixIndex`` in this process) and ``ServiceFollower`` (``kvevents serve`` in its own
process) each wait until they have applied every batch the engine published, then predict.

vLLM never serves a whole prompt from its cache: the last prompt token is always computed, so
a hit is at most ``(len(prompt) - 1) // block_size`` blocks (``expected_hit``).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import kvevents
from kvevents.deadline import Deadline
from kvevents.index._prefix import PrefixIndex
from kvevents.subscribe import Delivery, StreamReset, Subscriber
from kvevents.subscribe._streams import StreamSpec
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.venvs import PeerSilent, peer_python, read_json_line

VLLM_PYTHON_ENV = "KVEVENTS_VLLM_PYTHON"
SCRIPT = Path(__file__).with_name("vllm_engine.py")
_VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
_PROBE = "import vllm, transformers; print(vllm.__version__)"
STARTUP_TIMEOUT = 240.0
REQUEST_TIMEOUT = 60.0
SYNC_TIMEOUT = 20.0
VOCAB = 1024  # the tiny model's (vllm_engine.py)


def find_vllm_python() -> str | None:
    """The interpreter that has vLLM, or None."""
    return peer_python(VLLM_PYTHON_ENV, ".venv-vllm")


@functools.cache
def vllm_version() -> tuple[str | None, str | None]:
    """(version, None) when vLLM imports in its interpreter, else (None, why not)."""
    python = find_vllm_python()
    if python is None:
        return None, f"no {_VENV_PYTHON} (run `make vllm`) and ${VLLM_PYTHON_ENV} is unset"
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} cannot run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import vllm: {last}"
    return done.stdout.strip().splitlines()[-1], None


def our_path() -> dict[str, str]:
    """``PYTHONPATH`` putting this process's kvevents first for vLLM's plugin.

    ``.venv-vllm`` has kvevents installed (for the plugin's entry point), possibly from
    another clone; the engine must run the code under test, wherever this checkout is.
    """
    ours = str(Path(kvevents.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": ours if not rest else os.pathsep.join([ours, rest])}


def expected_hit(matched_blocks: int, prompt_len: int, block_size: int) -> int:
    """The tokens vLLM serves from cache when ``matched_blocks`` of the prompt are cached."""
    return min(matched_blocks, (prompt_len - 1) // block_size) * block_size


class EngineError(RuntimeError):
    """The engine could not start, died, or did not answer in time."""


@dataclass
class VllmEngine:
    """``vllm.LLM`` in a subprocess, publishing KV events on ipc endpoints in ``directory``."""

    python: str
    directory: Path
    model_dir: Path
    block_size: int = 32
    num_blocks: int = 16
    publisher: str = "zmq"
    extra_env: dict[str, str] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=dict)
    startups: list[float] = field(default_factory=list)
    publisher_class: str = ""
    kvevents_file: str | None = None  #: the kvevents vLLM's plugin loaded (None: not loaded)
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.directory}/pub"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{self.directory}/replay"

    def start(self) -> VllmEngine:
        """Launch and return once the engine serves (bounded by ``STARTUP_TIMEOUT``)."""
        spec = {
            "model_dir": str(self.model_dir),
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "publisher": self.publisher,
            "engine_args": self.engine_args,
        }
        self._log = open(self.directory / "engine.log", "ab")  # noqa: SIM115 (closed in stop)
        deadline = Deadline(STARTUP_TIMEOUT)
        self._proc = subprocess.Popen(
            [self.python, str(SCRIPT), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **self.extra_env, **our_path()},
        )
        ready = self._read(deadline, "start")
        self.startups.append(STARTUP_TIMEOUT - deadline.remaining())
        if not ready.get("ready"):
            raise EngineError(f"engine did not start: {ready}")
        self.publisher_class = f"{ready['publisher']}.{ready['publisher_class']}"
        self.kvevents_file = ready.get("kvevents")
        return self

    def _read(self, deadline: Deadline, what: str) -> dict[str, Any]:
        assert self._proc is not None
        try:
            return read_json_line(self._proc, deadline)
        except PeerSilent as exc:
            raise EngineError(f"engine {exc} during {what}: {self.log_tail()}") from None

    def call(self, request: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        """One request line, one reply line (bounded by ``timeout``)."""
        assert self._proc is not None and self._proc.stdin is not None, "start() first"
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        return self._read(Deadline(timeout), request["op"])

    def generate(self, prompt: Sequence[int], cache_salt: str | None = None) -> tuple[int, int]:
        """(num_cached_tokens, batches published so far) for one prompt."""
        reply = self.call({"op": "generate", "prompt": list(prompt), "cache_salt": cache_salt})
        return int(reply["cached"]), int(reply["published"])

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.directory / "engine.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Quit (then kill after a bound); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(b'{"op": "quit"}\n')
                    proc.stdin.close()
                proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


class Follower(Protocol):
    """A consumer of the engine's stream that can predict hits."""

    name: str

    def synced(self, published: int, restarts: int) -> bool: ...

    def clears(self) -> int:
        """``AllBlocksCleared`` events applied so far."""
        ...

    def matched_blocks(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Blocks of ``tokens`` held on rank 0; ``salt`` is the request's ``cache_salt``."""
        ...

    def close(self) -> None: ...


class IndexFollower:
    """Our ``Subscriber`` feeding a ``PrefixIndex``, consumed on the test's thread."""

    def __init__(self, engine: VllmEngine, worker: str = "vllm", name: str = "index") -> None:
        self.name = name
        self.worker = worker
        self.index = PrefixIndex(block_size=engine.block_size)
        self.index.register_worker(worker, block_size=engine.block_size, ranks=1)
        spec = StreamSpec(worker, 0, engine.endpoint, engine.replay_endpoint)
        self.subscriber = Subscriber([spec])
        self.subscriber.start()
        self.next_seq = 0
        self.resets = 0
        self.payloads: list[Any] = []

    def synced(self, published: int, restarts: int) -> bool:
        """Apply what arrived; True once every published batch (and restart) is applied."""
        self._drain()
        return self.resets >= restarts and self.next_seq >= published

    def _drain(self) -> None:
        """Apply every item the subscriber has delivered (briefly waiting for one)."""
        while (item := self.subscriber.get(timeout=0.02)) is not None:
            if isinstance(item, Delivery):
                self.index.apply(self.worker, 0, item.batch)
                self.payloads.append(item.batch)
                self.next_seq = item.seq + 1
            elif isinstance(item, StreamReset):
                self.index.reset_stream(self.worker, 0)
                self.resets += 1
                self.next_seq = 0

    def clears(self) -> int:
        self._drain()
        return self.index.stats().clears

    def matched_blocks(self, tokens: Sequence[int], salt: str | None = None) -> int:
        return self.index.match(tokens, cache_salt=salt).streams.get((self.worker, 0), 0)

    def stream(self) -> Any:
        return self.subscriber.stream_stats()[(self.worker, 0)]

    def close(self) -> None:
        self.subscriber.close()


class ServiceFollower:
    """``kvevents serve`` in its own process, registered with the engine's endpoints."""

    def __init__(self, engine: VllmEngine, worker: str = "vllm", name: str = "service") -> None:
        self.name = name
        self.worker = worker
        # The engine publishes on ipc:// endpoints: allow them (loopback tcp only by default).
        self.service = ServiceIndexer(args=["--allow-endpoint-host", "ipc"]).start()
        try:
            self.service.register(
                worker,
                engine.endpoint,
                block_size=engine.block_size,
                replay_endpoint=engine.replay_endpoint,
            )
        except BaseException:
            self.service.close()
            raise

    def _get(self, path: str) -> dict[str, Any]:
        reply: dict[str, Any]
        try:
            reply = self.service.call("GET", path)
        except (http.client.RemoteDisconnected, ConnectionError):
            # uvicorn closes a kept-alive connection idle for 5 s (an engine restart takes
            # longer); the helper has dropped it, and the retry opens a new one.
            reply = self.service.call("GET", path)
        return reply

    def _workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = self._get("/workers")["workers"]
        return workers

    def stream(self) -> dict[str, Any]:
        (worker,) = [w for w in self._workers() if w["worker_id"] == self.worker]
        stream: dict[str, Any] = worker["ranks"][0]["stream"] or {}
        return stream

    def synced(self, published: int, restarts: int) -> bool:
        stream = self.stream()
        last = stream.get("last_seq")
        delivered = -1 if last is None else last
        return stream.get("restarts", 0) >= restarts and delivered + 1 >= published

    def clears(self) -> int:
        return int(self._get("/dump")["stats"]["clears"])

    def matched_blocks(self, tokens: Sequence[int], salt: str | None = None) -> int:
        body = {"token_ids": list(tokens), "cache_salt": salt}
        reply: dict[str, Any] = self.service.call("POST", "/query", body)
        return int(reply["scores"].get(self.worker, {}).get("0", 0))

    def close(self) -> None:
        self.service.close()


def wait_synced(
    followers: Sequence[Follower], published: int, restarts: int, timeout: float = SYNC_TIMEOUT
) -> list[str]:
    """Wait (bounded) until every follower applied ``published`` batches; the names that did not."""
    deadline = Deadline(timeout)
    pending = list(followers)
    while pending and not deadline.expired:
        pending = [f for f in pending if not f.synced(published, restarts)]
        if pending:
            time.sleep(0.01)
    return [f.name for f in pending]


def scratch_dir(prefix: str) -> Path:
    """A short temporary directory (ipc paths must stay under ~100 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


@dataclass
class Row:
    """One compared request."""

    test: str
    prompt_len: int
    salt: str | None
    actual: int
    predicted: dict[str, int]
    seconds: float


@dataclass
class Harness:
    """The engine, the followers, and every comparison made."""

    engine: VllmEngine
    followers: list[Follower]
    rows: list[Row] = field(default_factory=list)
    published: int = 0
    restarts: int = 0
    test: str = ""

    def sync(self, followers: Sequence[Follower] | None = None, timeout: float = 20.0) -> None:
        late = wait_synced(followers or self.followers, self.published, self.restarts, timeout)
        assert not late, f"{late} did not apply the engine's {self.published} batches in time"

    def request(self, prompt: Sequence[int], salt: str | None = None) -> Row:
        """Predict with every follower, then run the prompt: the comparison."""
        self.sync()
        predicted = {
            f.name: expected_hit(
                f.matched_blocks(prompt, salt), len(prompt), self.engine.block_size
            )
            for f in self.followers
        }
        start = time.perf_counter()
        actual, self.published = self.engine.generate(prompt, salt)
        row = Row(self.test, len(prompt), salt, actual, predicted, time.perf_counter() - start)
        self.rows.append(row)
        return row

    def reset_prefix_cache(self, timeout: float = SYNC_TIMEOUT) -> bool:
        """The control plane's reset: vLLM's reset, a flush step, then a handshake on the clear.

        vLLM queues ``AllBlocksCleared`` at the reset and publishes it with the batch of its
        next step, after that step has scheduled against the emptied cache: the request that
        makes the step is the one a router would mispredict. A one-token request (no full block
        to store) is that step instead; the followers then wait, bounded, until they applied a
        clear, as a router that triggered the reset can.
        """
        if not self.engine.call({"op": "reset"})["reset"]:
            return False
        before = {f.name: f.clears() for f in self.followers}
        _, self.published = self.engine.generate([1])
        deadline = Deadline(timeout)
        pending = list(self.followers)
        while pending and not deadline.expired:
            pending = [f for f in pending if f.clears() <= before[f.name]]
            time.sleep(0.01 if pending else 0)
        assert not pending, f"{[f.name for f in pending]} applied no AllBlocksCleared in time"
        self.sync()  # the harness's own check: nothing else is in flight
        return True

    def prime(self, followers: Sequence[Follower], rng: random.Random) -> None:
        """Handshake: primer requests until ``followers`` applied one (a SUB connects late)."""
        for _ in range(5):
            _, self.published = self.engine.generate(tokens(rng, self.engine.block_size + 1))
            if not wait_synced(followers, self.published, self.restarts, timeout=3.0):
                return
        self.sync(followers)

    def disagreements(self, rows: Sequence[Row]) -> list[Row]:
        return [r for r in rows if any(p != r.actual for p in r.predicted.values())]


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids: two tests never share a block."""
    return [rng.randrange(1, VOCAB) for _ in range(n)]
