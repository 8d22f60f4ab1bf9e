"""NVIDIA Dynamo's standalone KV indexer as a test peer: start it, register streams, query it.

Dynamo ships the indexer in the ``ai-dynamo-runtime`` wheel (``python -m dynamo.indexer``). It
subscribes to our PUB sockets, asks our ROUTER for replays, and answers HTTP queries, so it is a
consumer nobody here wrote. Its dependencies clash with nothing of ours, but the wheel is large,
so it usually lives in a venv of its own: :func:`find_dynamo_python` looks for it in
``$KVEVENTS_DYNAMO_PYTHON``, then ``.venv-dynamo/bin/python`` in the working directory and its
parents, then the running interpreter.

Facts about the peer (ai-dynamo-runtime 1.6.1) that the helpers below rely on:

- it runs with no etcd or NATS: HTTP on ``0.0.0.0:PORT``, ZMQ SUB/DEALER sockets that connect;
- ``/query`` answers in matched *tokens* per instance and dp rank (blocks x block size), of
  the named model's workers only (``model_name`` is required);
- ``/register`` takes one dp rank on its own endpoint; a rank registered twice, an instance
  under a second model or a model under a second block size is a 409;
- it keys blocks by its own hash of each block's tokens, XXH3-64 with seed 1337 over the token
  ids as little-endian u32, not chained (the tree gives the prefix); see
  :func:`dynamo_block_hashes`. Engine hashes are kept per worker for parents and removals.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvevents._types import Document
from kvevents.testing._process import IndexerProcess
from kvevents.testing.sockets import Deadline
from kvevents.testing.venvs import peer_pythons

__all__ = [
    "DYNAMO_PYTHON_ENV",
    "DynamoIndexer",
    "DynamoIndexerError",
    "dump_block_hashes",
    "dynamo_block_hashes",
    "dynamo_unavailable_reason",
    "find_dynamo_python",
]

#: Environment variable naming the interpreter that has ``ai-dynamo-runtime`` installed.
DYNAMO_PYTHON_ENV = "KVEVENTS_DYNAMO_PYTHON"
_HASH_SEED = 1337
_PROBE = "import dynamo.indexer.main, dynamo.llm; print('ok')"


class DynamoIndexerError(RuntimeError):
    """The indexer could not start, died, or answered an HTTP call with an error status."""


def _candidates() -> Iterable[str]:
    yield from peer_pythons(DYNAMO_PYTHON_ENV, ".venv-dynamo")
    yield sys.executable


def _probe(python: str) -> str | None:
    """None when ``python`` can import the indexer, else why not."""
    if not (Path(python).exists() or shutil.which(python)):
        return f"{python} does not exist"
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot run: {exc}"
    if done.returncode != 0 or "ok" not in done.stdout:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import dynamo.indexer: {last}"
    return None


def _search() -> tuple[str | None, list[str]]:
    """The first interpreter that can import the indexer, and why the others could not."""
    failures: list[str] = []
    for python in dict.fromkeys(_candidates()):
        reason = _probe(python)
        if reason is None:
            return python, failures
        failures.append(reason)
    return None, failures


def find_dynamo_python() -> str | None:
    """The first interpreter that can import ``dynamo.indexer``, or None."""
    return _search()[0]


def dynamo_unavailable_reason() -> str | None:
    """None when the indexer can run here, else a sentence saying what is missing."""
    python, failures = _search()
    if python is not None:
        return None
    return (
        "NVIDIA Dynamo's indexer is not installed (pip install ai-dynamo-runtime into "
        f".venv-dynamo, or set ${DYNAMO_PYTHON_ENV}); " + "; ".join(failures)
    )


def dynamo_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Dynamo's hash of each full block of ``token_ids`` (what ``/query_by_hash`` takes)."""
    import xxhash  # the `index` extra; only this helper needs it

    full = len(token_ids) - len(token_ids) % block_size
    return [
        xxhash.xxh3_64_intdigest(_u32le(token_ids[i : i + block_size]), seed=_HASH_SEED)
        for i in range(0, full, block_size)
    ]


def _u32le(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def dump_block_hashes(dump: Document, model_name: str) -> dict[tuple[int, int], set[int]]:
    """Engine block hashes present in a ``/dump``, per (instance id, dp rank)."""
    held: dict[tuple[int, int], set[int]] = {}
    for key, tree in dump.items():
        if key.split(":", 1)[0] != model_name:
            continue
        for item in tree.get("events", []):
            stored = item["event"]["data"].get("stored")
            if stored is None:
                continue
            owner = (int(item["worker_id"]), int(item["event"].get("dp_rank") or 0))
            held.setdefault(owner, set()).update(b["block_hash"] for b in stored["blocks"])
    return held


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class DynamoIndexer(IndexerProcess):
    """``python -m dynamo.indexer`` in a subprocess on a free port, with an HTTP client.

    ``start()`` returns once ``/health`` answers (bounded by ``startup_timeout``) and raises
    :class:`DynamoIndexerError` with the log tail if the process exits first. ``stop()`` sends
    SIGINT, then SIGKILL after ``stop_timeout``. One instance is used from one thread.
    """

    error = DynamoIndexerError
    log_name = "indexer.log"

    def __init__(
        self,
        *,
        python: str | None = None,
        model_name: str = "kvevents",
        threads: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        http_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            startup_timeout=startup_timeout, stop_timeout=stop_timeout, http_timeout=http_timeout
        )
        self.python = python
        self.model_name = model_name
        self.threads = threads

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> DynamoIndexer:
        """Launch the indexer and wait until its HTTP API answers."""
        if self._proc is not None:
            return self
        python = self.python or find_dynamo_python()
        if python is None:
            raise DynamoIndexerError(dynamo_unavailable_reason() or "indexer not found")
        self._new_log_dir("kvevents-dynamo-")
        deadline = Deadline(self.startup_timeout)
        # A port picked by bind-and-close can be taken before the indexer binds it: retry.
        for _attempt in range(3):
            self._launch(python)
            if self._wait_ready(deadline):
                return self
        raise DynamoIndexerError(f"indexer did not start: {self.log_tail()}")

    def _launch(self, python: str) -> None:
        self.port = _free_port()
        args = [python, "-m", "dynamo.indexer", "--port", str(self.port)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        assert self._log_dir is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it after Popen
        env = {**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"}
        with log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _wait_ready(self, deadline: Deadline) -> bool:
        """True once /health answers; False if the process exited (e.g. port taken)."""
        assert self._proc is not None
        while self._proc.poll() is None:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.send("GET", "/health", timeout=1.0)[0] == 200:
                    return True
            if deadline.expired:
                self.stop()
                raise DynamoIndexerError(
                    f"indexer not ready within {self.startup_timeout}s: {self.log_tail()}"
                )
            time.sleep(0.02)
        self._proc = None
        return False

    # ------------------------------------------------------------------ HTTP

    def register(
        self,
        instance_id: int,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
    ) -> None:
        """Subscribe the indexer to one rank's PUB endpoint (and replay ROUTER)."""
        body: Document = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": self.model_name,
            "block_size": block_size,
            "dp_rank": dp_rank,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self.call("POST", "/register", body)

    def unregister(self, instance_id: int, dp_rank: int | None = None) -> None:
        """Drop an instance (or one of its ranks) and everything it held.

        The indexer drops a rank alone only when the body names the routing group too; a
        ``dp_rank`` without it drops the whole instance.
        """
        body: Document = {"instance_id": instance_id, "model_name": self.model_name}
        if dp_rank is not None:
            body.update(dp_rank=dp_rank, routing_group="default")
        self.call("POST", "/unregister", body)

    def workers(self) -> list[Document]:
        """``GET /workers``: registrations with their listener status."""
        result: list[Document] = self.call("GET", "/workers")
        return result

    def dump(self) -> Document:
        """``GET /dump``: every indexed block, as store events per model."""
        result: Document = self.call("GET", "/dump")
        return result

    def query(self, token_ids: Sequence[int]) -> Document:
        """``POST /query``: the raw reply (matched tokens per instance and dp rank)."""
        body = {"token_ids": list(token_ids), "model_name": self.model_name}
        result: Document = self.call("POST", "/query", body)
        return result

    def query_by_hash(self, block_hashes: Sequence[int]) -> Document:
        """``POST /query_by_hash`` with Dynamo's own block hashes (:func:`dynamo_block_hashes`).

        ``/dump`` prints these hashes as u64 but this endpoint only parses i64, so the upper
        half is sent as its two's-complement value.
        """
        signed = [h - 2**64 if h >= 2**63 else h for h in block_hashes]
        body = {"block_hashes": signed, "model_name": self.model_name}
        result: Document = self.call("POST", "/query_by_hash", body)
        return result

    def matched_blocks(
        self, token_ids: Sequence[int], block_size: int
    ) -> dict[tuple[int, int], int]:
        """Matched prefix length in blocks per (instance id, dp rank); absent means 0."""
        scores = self.query(token_ids).get("scores", {})
        return {
            (int(worker), int(rank)): tokens // block_size
            for worker, ranks in scores.items()
            for rank, tokens in ranks.items()
            if tokens
        }

    def held_blocks(self) -> dict[tuple[int, int], set[int]]:
        """Engine block hashes the indexer holds per (instance id, dp rank), from ``/dump``."""
        return dump_block_hashes(self.dump(), self.model_name)
