"""The routers of ``bench_route``: each peer in a venv of its own, installed by the benchmark.

A :class:`Router` is one entry of the side-by-side: a name, how to install it (a pip spec in
its own venv under ``bench/.work/route/venvs``; nothing for the references and for
``kvevents route``, which runs from this checkout), and the command line that puts it in front
of the engines. References have no process: the client talks to an engine directly.

Peers are run as their documentation says (the flags below); where the rig's engines make a
peer run differently than its users' would, :data:`CONFIG_NOTES` says so (docs/benchmarks.md
repeats it).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvevents.deadline import Deadline
from kvevents.testing.vllm_server import free_port
from route_engines import MODEL_NAME, BenchEngine

VLLM_ROUTER = "vllm-router==0.1.17"
SGLANG_ROUTER = "sglang-router==0.3.2"
AIPERF = "aiperf==0.13.0"
ROUTER_STARTUP_TIMEOUT = 120.0
INSTALL_TIMEOUT = 900.0

#: Where a peer here runs differently from how its users would run it, and why.
CONFIG_NOTES = {
    "engines": (
        "every engine runs with vLLM's --enable-scale-out, which only registers the render "
        "endpoints (/v1/chat/completions/render, /v1/completions/render): vLLM Router's "
        "kv_aware and cache_aware ask every worker to render each request and, on a plain "
        "`vllm serve` (403 there, and no fallback to /tokenize on 403), get no cache credit "
        "and route on load alone"
    ),
    "vllm-router": (
        "as its CLI reference says: --worker-urls, --policy, --kv-event-source and "
        "--kv-event-replay-source per worker, --kv-event-model, --kv-event-block-size equal "
        "to the engines' (32), the engines' topic empty (it ignores any other); the rest "
        "default (health checks every 60 s, 5 retries, circuit breaker after 10 failures)"
    ),
    "sglang-router": (
        "`smg launch --policy cache_aware` fronting vLLM engines (it needs only /health and the "
        "OpenAI routes); --host and --prometheus-host 127.0.0.1 (it binds 0.0.0.0 by default); "
        "the rest default"
    ),
}


@dataclass(frozen=True)
class Venv:
    """A venv of its own for one pip requirement; ``ensure()`` installs it when missing."""

    name: str
    requirement: str
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.name

    def bin(self, program: str) -> Path:
        return self.path / "bin" / program

    def installed_version(self) -> str | None:
        """The installed version of the requirement's package, or None."""
        package = self.requirement.split("==")[0]
        python = self.bin("python")
        if not python.exists():
            return None
        done = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return done.stdout.strip() if done.returncode == 0 else None

    def ensure(self) -> str | None:
        """None once the requirement is installed, else why it could not be (the pip error)."""
        wanted = self.requirement.split("==")[-1]
        if self.installed_version() == wanted:
            return None
        log = self.root / f"{self.name}.install.log"
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            with log.open("w") as out:
                pip = [str(self.bin("python")), "-m", "pip", "install", "--quiet"]
                steps = [
                    [sys.executable, "-m", "venv", str(self.path)],
                    [*pip, "--disable-pip-version-check", self.requirement],
                ]
                for step in steps:
                    subprocess.run(
                        step,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=INSTALL_TIMEOUT,
                        check=True,
                    )
        except (OSError, subprocess.SubprocessError) as exc:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            return f"pip install {self.requirement} failed ({exc}): {' / '.join(tail)}"
        got = self.installed_version()
        return None if got == wanted else f"{self.requirement} installed as {got}"


@dataclass(frozen=True)
class Launch:
    """What a router's command line is built from."""

    port: int
    metrics_port: int
    engines: Sequence[BenchEngine]
    model_dir: Path
    block_size: int


Command = Callable[[Launch], list[str]]


@dataclass(frozen=True)
class Router:
    """One entry of the side-by-side.

    ``command`` is None for the references (the client talks to ``target`` directly:
    ``"pooled"``, the one engine with the cluster's whole cache, or ``"floor"``, one engine of
    the cluster serving everything). ``venv`` is None where nothing is installed.
    """

    name: str
    kind: str  # "peer", "reference" or "kvevents"
    command: Command | None = None
    venv: Venv | None = None
    target: str = "cluster"
    version: str = ""


def slug(name: str) -> str:
    """A router's name as a directory name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _urls(launch: Launch) -> list[str]:
    return [engine.url for engine in launch.engines]


def _vllm_router(policy: str, venv: Venv) -> Command:
    def command(launch: Launch) -> list[str]:
        args = [
            str(venv.bin("vllm-router")),
            *("--host", "127.0.0.1", "--port", str(launch.port), "--policy", policy),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(launch.metrics_port)),
            "--worker-urls",
            *_urls(launch),
        ]
        if policy == "kv_aware":
            for engine in launch.engines:
                args += ["--kv-event-source", f"{engine.url}={engine.event_endpoint()}"]
                args += ["--kv-event-replay-source", f"{engine.url}={engine.replay_endpoint()}"]
            args += [
                "--kv-event-model",
                MODEL_NAME,
                "--kv-event-block-size",
                str(launch.block_size),
            ]
        return args

    return command


def _sglang_router(venv: Venv) -> Command:
    def command(launch: Launch) -> list[str]:
        return [
            str(venv.bin("smg")),
            "launch",
            *("--host", "127.0.0.1", "--port", str(launch.port), "--policy", "cache_aware"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(launch.metrics_port)),
            "--worker-urls",
            *_urls(launch),
        ]

    return command


def kvevents_route_command(policy: str | None, extra: Sequence[str] = ()) -> Command:
    """``kvevents route`` from this checkout, in front of every engine with its event stream
    (``extra``: more of its flags)."""

    def command(launch: Launch) -> list[str]:
        args = [
            sys.executable,
            *("-m", "kvevents.cli", "route", "--host", "127.0.0.1", "--port", str(launch.port)),
            *("--tokenizer", str(launch.model_dir), "--block-size", str(launch.block_size)),
        ]
        for engine in launch.engines:
            args += ["--engine", engine.url]
            args += ["--kv-events", f"{engine.url}={engine.event_endpoint()}"]
            args += ["--kv-replay", f"{engine.url}={engine.replay_endpoint()}"]
        return [*args, *(("--policy", policy) if policy else ()), *extra]

    return command


def kvevents_route_unavailable() -> str | None:
    """None when ``kvevents route --help`` works in this interpreter, else why not."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvevents.cli", "route", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"kvevents route --help: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"kvevents route --help exited {done.returncode}: {last}"
    return None


def kvevents_policies() -> tuple[str, list[str]]:
    """``kvevents route``'s default policy (its settings') and the index's others."""
    from kvevents.cli.config import RouteSettings
    from kvevents.index import POLICIES

    default = str(RouteSettings.model_fields["policy"].default)
    return default, [name for name in POLICIES if name != default]


def routers(venv_root: Path, *, quick: bool) -> list[Router]:
    """Every entry, peers first; ``quick`` keeps one of each kind."""
    vllm = Venv("vllm-router", VLLM_ROUTER, venv_root)
    sglang = Venv("sglang-router", SGLANG_ROUTER, venv_root)
    entries = [
        Router("pooled cache (reference)", "reference", target="pooled"),
        Router("one engine (floor)", "reference", target="floor"),
        Router("vllm-router round_robin", "peer", _vllm_router("round_robin", vllm), vllm),
        Router("vllm-router kv_aware", "peer", _vllm_router("kv_aware", vllm), vllm),
        Router("vllm-router cache_aware", "peer", _vllm_router("cache_aware", vllm), vllm),
        Router("sglang-router cache_aware", "peer", _sglang_router(sglang), sglang),
    ]
    if quick:
        entries = [entries[1], entries[3], entries[5]]
    _, others = kvevents_policies()
    entries.append(Router("kvevents route (default)", "kvevents", kvevents_route_command(None)))
    # KVEVENTS_BENCH_ROUTE_VARIANT="--prediction-grace 0": the default with other flags too.
    variant = os.environ.get("KVEVENTS_BENCH_ROUTE_VARIANT", "").split()
    if variant:
        name = f"kvevents route (default, {' '.join(variant)})"
        entries.append(Router(name, "kvevents", kvevents_route_command(None, variant)))
    if not quick:
        for policy in others:
            entries.append(
                Router(f"kvevents route {policy}", "kvevents", kvevents_route_command(policy))
            )
    return entries


class RouterProcess:
    """A running router: started, waited for (``/health``), stopped with its process group."""

    def __init__(self, argv: list[str], log_path: Path, port: int, metrics_port: int) -> None:
        self.argv = argv
        self.log_path = log_path
        self.port = port
        self.metrics_port = metrics_port
        self._log = log_path.open("ab")
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout: float = ROUTER_STARTUP_TIMEOUT) -> float:
        """Seconds until ``/health`` and ``/v1/models`` answer 200; raises if it dies or stalls."""
        began = time.monotonic()
        deadline = Deadline(timeout)
        while not (_get(self.port, "/health") == 200 and _get(self.port, "/v1/models") == 200):
            if self._proc.poll() is not None:
                raise RuntimeError(f"router exited ({self._proc.returncode}):\n{self.log_tail()}")
            if deadline.expired:
                raise RuntimeError(f"router not ready in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)
        return time.monotonic() - began

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(15)
        self._log.close()


def _get(port: int, path: str) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


def fetch_text(url_port: int, path: str) -> str:
    """A GET's body as text ('' when it fails): a router's /metrics after its run."""
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode(errors="replace")
    except OSError:
        return ""
    finally:
        conn.close()


def start_router(router: Router, launch: Launch, log_path: Path) -> RouterProcess:
    """Launch ``router`` for ``launch`` and wait until it serves."""
    assert router.command is not None
    process = RouterProcess(router.command(launch), log_path, launch.port, launch.metrics_port)
    try:
        process.wait_ready()
    except BaseException:
        process.stop()
        raise
    return process


def new_launch(engines: Sequence[BenchEngine], model_dir: Path, block_size: int) -> Launch:
    return Launch(free_port(), free_port(), engines, model_dir, block_size)
