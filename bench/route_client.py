"""The benchmark client of ``bench_route``: NVIDIA's aiperf (PyPI), nobody here wrote it.

aiperf 0.13.0 runs in a venv of its own. Per run it gets the workload file (``multi_turn`` for
the chat, ``mooncake_trace`` for the trace), the engines' tokenizer (``--tokenizer DIR``), a
fixed ``--concurrency`` and exactly as many requests as the file holds, streams (TTFT is the
first content chunk), and reads the engine's usage (``--use-server-token-count``: prompt
tokens and ``prompt_tokens_details.cached_tokens``, which it reports as
``usage_prompt_cache_read_tokens``). Answers are of a fixed length (``ignore_eos``: the tiny
model's random weights would otherwise stop anywhere).

Its own report (``profile_export_aiperf.json`` / ``.csv``, one record per request in
``profile_export.jsonl``, and with ``raw`` export each request as sent) stays in the run's
directory next to ours; :func:`read_records` reads the per-request records.

The tokenizer is handed to aiperf as a model id of a local Hugging Face cache
(:func:`tokenizer_alias`, with ``HF_HUB_OFFLINE=1``): aiperf 0.13.0 cannot load a tokenizer
from a directory path in its ``mooncake_trace`` prompt synthesis (its worker processes set
``HF_HUB_OFFLINE=1`` and then look the path up as a repository id in the cache).

Checked here (``bench_route`` records it for every chat run): in a ``multi_turn`` run every
later turn carries the engine's own earlier answers as ``assistant`` messages. Seen while
building the rig: after a failed turn, aiperf sends the conversation's next turn without its
history (system prompt and the new question only).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from route_engines import MODEL_NAME

CLIENT_TIMEOUT = 1800.0
#: Seconds aiperf waits for requests in flight when its benchmark duration ends.
CLIENT_GRACE = 30.0


ALIAS = "local/chat"
_REVISION = "0" * 40


@dataclass(frozen=True)
class ClientRun:
    """One client run: the workload file and how to send it (``requests`` of the file, or
    for ``duration`` seconds, as many as it takes)."""

    input_file: Path
    dataset_type: str  # "multi_turn" or "mooncake_trace"
    requests: int
    concurrency: int
    block_size: int
    seed: int = 25
    duration: float | None = None
    #: Keep each answer's HTTP headers (aiperf's --export-http-trace): the front door's
    #: x-kvevents-engine and x-kvevents-predicted-cached-tokens, request by request.
    http_trace: bool = False


def tokenizer_alias(model_dir: Path, hf_home: Path) -> str:
    """``model_dir``'s tokenizer files as the snapshot of :data:`ALIAS` in ``hf_home``'s cache."""
    repo = hf_home / "hub" / ("models--" + ALIAS.replace("/", "--"))
    snapshot = repo / "snapshots" / _REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_REVISION)
    for source in model_dir.iterdir():
        if source.suffix in (".json", ".jinja", ".txt", ".model"):
            link = snapshot / source.name
            if not link.exists():
                link.symlink_to(source.resolve())
    return ALIAS


def client_env(hf_home: Path) -> dict[str, str]:
    """The client's environment: the local cache, offline (nothing is downloaded)."""
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Record:
    """One request as the client saw it."""

    conversation: str
    turn: int
    start_s: float  # wall clock (the client's time.time_ns)
    end_s: float
    ttft_ms: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None  # kind: "HTTP 500", "connection reset", ...
    engine: str | None = None  # x-kvevents-engine, when the router said
    predicted_cached: int | None = None  # x-kvevents-predicted-cached-tokens, when it said


def aiperf_argv(aiperf: Path, url: str, tokenizer: str, run: ClientRun, out: Path) -> list[str]:
    """The client's command line for one run."""
    argv = [
        str(aiperf),
        "profile",
        *("--model", MODEL_NAME, "--url", url, "--endpoint-type", "chat", "--streaming"),
        *("--input-file", str(run.input_file), "--custom-dataset-type", run.dataset_type),
        *("--tokenizer", tokenizer, "--concurrency", str(run.concurrency)),
        "--use-server-token-count",
        "--no-server-metrics",  # the rig reads the engines' /metrics itself (less CPU here)
        *("--extra-inputs", "ignore_eos:true", "--random-seed", str(run.seed)),
        *("--export-level", "raw", "--output-artifact-dir", str(out), "--ui-type", "none"),
    ]
    if run.duration is None:
        argv += ["--request-count", str(run.requests)]
    else:
        argv += ["--benchmark-duration", f"{run.duration:.0f}"]
        argv += ["--benchmark-grace-period", f"{CLIENT_GRACE:.0f}"]
    if run.http_trace:
        argv.append("--export-http-trace")
    if run.dataset_type == "mooncake_trace":
        argv += ["--isl-block-size", str(run.block_size), "--no-fixed-schedule"]
    return argv


def run_client(
    argv: Sequence[str], out: Path, env: dict[str, str], timeout: float = CLIENT_TIMEOUT
) -> float:
    """Run the client to completion (its console output in ``out/client.log``); seconds taken."""
    client = Client(argv, out, env)
    return client.wait(timeout)


class Client:
    """The client as a process group of its own: waited for, or stopped (SIGINT: aiperf then
    cancels what is in flight and writes its reports as usual)."""

    def __init__(self, argv: Sequence[str], out: Path, env: dict[str, str]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.started = time.time()
        self.stopped_at: float | None = None  # wall clock of stop(), when it was stopped
        self._log = (out / "client.log").open("wb")
        self._proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def elapsed(self) -> float:
        return time.time() - self.started

    def running(self) -> bool:
        return self._proc.poll() is None

    def sleep_until(self, seconds: float) -> None:
        """Until ``seconds`` after the start, or the client's end if sooner."""
        while self.elapsed() < seconds and self.running():
            time.sleep(0.2)

    def stop(self) -> None:
        """Ask the client to finish now (SIGINT to its process group)."""
        if self.running():
            self.stopped_at = time.time()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGINT)

    def wait(self, timeout: float = CLIENT_TIMEOUT) -> float:
        """Seconds from start to end; raises when the client failed (the log's tail)."""
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(30)
            raise RuntimeError(f"aiperf did not finish in {timeout:.0f} s") from None
        finally:
            self._log.close()
        if code != 0:
            tail = (self.out / "client.log").read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"aiperf exited {code}:\n" + "\n".join(tail))
        return self.elapsed()


def _value(metrics: dict[str, Any], name: str) -> Any:
    entry = metrics.get(name)
    return entry.get("value") if isinstance(entry, dict) else entry


def error_kind(error: dict[str, Any] | None) -> str | None:
    """A short kind for a failed request: ``HTTP <code>`` or the client's error type."""
    if not error:
        return None
    code = error.get("code")
    if isinstance(code, int) and code >= 100:
        return f"HTTP {code}"
    return str(error.get("type") or "error")


def parse_record(line: str) -> Record:
    """One line of aiperf's ``profile_export.jsonl``."""
    data = json.loads(line)
    meta, metrics = data.get("metadata", {}), data.get("metrics", {})
    ttft = _value(metrics, "time_to_first_token")
    prompt = _value(metrics, "usage_prompt_tokens")
    cached = _value(metrics, "usage_prompt_cache_read_tokens")
    headers = {
        k.lower(): v
        for k, v in ((data.get("trace_data") or {}).get("response_headers") or {}).items()
    }
    predicted = headers.get("x-kvevents-predicted-cached-tokens")
    return Record(
        conversation=str(meta.get("conversation_id", "")),
        turn=int(meta.get("turn_index", 0)),
        start_s=int(meta.get("request_start_ns", 0)) / 1e9,
        end_s=int(meta.get("request_end_ns", 0) or meta.get("request_start_ns", 0)) / 1e9,
        ttft_ms=float(ttft) if ttft is not None else None,
        prompt_tokens=int(prompt) if prompt is not None else None,
        cached_tokens=int(cached) if cached is not None else None,
        error=error_kind(data.get("error")),
        engine=headers.get("x-kvevents-engine"),
        predicted_cached=int(predicted) if predicted is not None and predicted.isdigit() else None,
    )


def read_records(out: Path) -> list[Record]:
    """Every request of a run, in the client's order of completion."""
    path = out / "profile_export.jsonl"
    return [parse_record(line) for line in path.read_text().splitlines() if line.strip()]


def sent_messages(out: Path) -> list[tuple[str, int, list[dict[str, Any]]]]:
    """(conversation, turn, messages as sent) for each request of a chat run (raw export)."""
    sent = []
    with (out / "profile_export_raw.jsonl").open() as handle:
        for line in handle:
            try:
                data = json.loads(line)
            except ValueError:  # cut off (see strip_raw): that request's messages are unknown
                continue
            meta, payload = data.get("metadata", {}), data.get("payload") or {}
            messages = payload.get("messages") or []
            sent.append(
                (str(meta.get("conversation_id")), int(meta.get("turn_index", 0)), messages)
            )
    return sent


def history_carries_answers(sent: Sequence[tuple[str, int, list[dict[str, Any]]]]) -> bool:
    """Whether every later turn sent the earlier answers (one assistant message per turn)."""
    later = [(turn, messages) for _, turn, messages in sent if turn > 0]
    return bool(later) and all(
        sum(m.get("role") == "assistant" and bool(m.get("content")) for m in messages) == turn
        for turn, messages in later
    )


def strip_raw(out: Path) -> int:
    """Drop the raw export's bulky streamed chunks (the payloads, the record, stay); a line
    that is not JSON (a client killed mid-write in the fault run left one cut off) is kept
    as it is. The number of such lines."""
    raw = out / "profile_export_raw.jsonl"
    if not raw.exists():
        return 0
    kept, broken = [], 0
    for line in raw.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            broken += 1
            kept.append(line)
            continue
        data.pop("responses", None)
        kept.append(json.dumps(data))
    raw.write_text("\n".join(kept) + "\n")
    return broken
