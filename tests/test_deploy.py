"""The deployment examples in deploy/: each is well-formed and its command lines parse."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvevents.cli import build_parser
from kvevents.cli.config import CONFIG_ENV, PublishSettings, ServeSettings, resolve
from kvevents.cli.serve import _registrations

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROOT = DEPLOY.parent


def serve_settings(argv: list[str], env: dict[str, str] | None = None) -> ServeSettings:
    """``argv`` (``serve ...``) parsed by our parser, its settings resolved and checked."""
    assert argv[0] == "serve", argv
    args = build_parser().parse_args(argv)
    settings = resolve(ServeSettings, "serve", args, env or {})
    _registrations(settings)  # every worker's endpoints hold for every rank
    return settings


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            rows.append((word.upper(), rest.strip()))
    return rows


def test_the_example_settings_file_is_valid() -> None:
    """deploy/serve.toml passes the same checks as any --config file."""
    settings = serve_settings(["serve", "--config", str(DEPLOY / "serve.toml")])
    assert (settings.host, settings.port) == ("0.0.0.0", 8090)


def test_dockerfile_runs_serve_as_a_user_with_a_healthcheck() -> None:
    """python:3.11-slim, non-root, the service extra, /health checked, its CMD our CLI's."""
    rows = dockerfile_instructions()
    froms = [rest for word, rest in rows if word == "FROM"]
    assert froms and all(f.split()[0] == "python:3.11-slim" for f in froms)
    final = max(i for i, (word, _) in enumerate(rows) if word == "FROM")
    image = rows[final:]
    words = [word for word, _ in image]
    user = next(rest for word, rest in image if word == "USER")
    assert user not in ("root", "0") and words.index("USER") < words.index("CMD")
    installs = [rest for word, rest in image if word == "RUN" and "pip install" in rest]
    assert installs and "[service]" in installs[0]
    assert any(
        "pip wheel" in rest and "'.[service]'" in rest for word, rest in rows if word == "RUN"
    )
    (port,) = [int(rest) for word, rest in image if word == "EXPOSE"]
    health = next(rest for word, rest in image if word == "HEALTHCHECK")
    assert f"http://127.0.0.1:{port}/health" in health
    cmd = json.loads(next(rest for word, rest in image if word == "CMD"))
    assert cmd[:2] == ["kvevents", "serve"]
    env = dict(rest.split("=", 1) for word, rest in image if word == "ENV")
    copied = {rest.split()[-1]: rest.split()[0] for word, rest in image if word == "COPY"}
    # The image's config file is deploy/serve.toml: resolve the CMD against it.
    settings = serve_settings(cmd[1:], {CONFIG_ENV: str(ROOT / copied[env[CONFIG_ENV]])})
    assert (settings.host, settings.port) == ("0.0.0.0", port)
    assert settings.state_file is not None and settings.state_file.startswith(
        next(rest for word, rest in image if word == "VOLUME")
    )


def _unit() -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in (DEPLOY / "kvevents-serve.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys.setdefault(key, value)
    return keys


def test_systemd_unit_runs_serve_with_the_example_settings() -> None:
    """ExecStart is our CLI with arguments it accepts; state and config in systemd's dirs."""
    unit = _unit()
    argv = shlex.split(unit["ExecStart"])
    assert argv[0].endswith("/kvevents")
    values = {"CONFIGURATION_DIRECTORY": str(DEPLOY), "STATE_DIRECTORY": "/state"}
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], a) for a in argv]
    settings = serve_settings(argv[1:])
    assert settings.state_file == "/state/state.json"
    assert unit["StateDirectory"] == "kvevents" and unit["Restart"] == "on-failure"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not here")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """``systemd-analyze verify`` finds nothing wrong (ExecStart pointed at this install)."""
    kvevents = Path(sys.executable).parent / "kvevents"
    assert kvevents.exists(), "the kvevents command of this environment"
    text = (DEPLOY / "kvevents-serve.service").read_text()
    unit = tmp_path / "kvevents-serve.service"
    unit.write_text(text.replace("/usr/local/bin/kvevents", str(kvevents)))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    about_it = [line for line in done.stderr.splitlines() if unit.name in line]
    assert done.returncode == 0 and about_it == [], done.stderr


def _kubernetes() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


def test_kubernetes_probes_ports_and_args_agree_with_the_cli(tmp_path: Path) -> None:
    """Probes hit /health on the port serve listens on; the Service and scrape use it too."""
    docs = _kubernetes()
    assert set(docs) == {"ConfigMap", "Deployment", "Service"}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    argv = [*container["command"][1:], *container["args"]]
    assert container["command"] == ["kvevents"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config = tmp_path / "serve.toml"  # the ConfigMap's file, where the mount puts it
    config.write_text(docs["ConfigMap"]["data"]["serve.toml"])
    config_arg = argv.index("--config") + 1
    assert Path(argv[config_arg]).parent == Path(mounts["config"])
    argv[config_arg] = str(config)
    settings = serve_settings(argv)
    assert settings.host == "0.0.0.0"
    assert settings.state_file is not None
    assert Path(settings.state_file).parent == Path(mounts["state"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.port
    assert annotations["prometheus.io/path"] == "/metrics"
    (service_port,) = docs["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == "http"
    assert docs["Service"]["spec"]["selector"] == pod["metadata"]["labels"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_compose_serves_the_engine_it_starts() -> None:
    """serve's --worker names the engine service on the ports the engine binds."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"engine", "serve"}
    engine_argv = services["engine"]["command"]
    assert engine_argv[0] == "kvevents"
    engine = resolve(PublishSettings, "publish", build_parser().parse_args(engine_argv[1:]), {})
    serve = services["serve"]
    assert serve["command"][0] == "kvevents"
    env = {k: str(v) for k, v in serve.get("environment", {}).items()}
    settings = serve_settings(serve["command"][1:], env)
    (worker,) = settings.workers
    engine_port = engine.endpoint.rsplit(":", 1)[1]
    replay_port = engine.replay_endpoint.rsplit(":", 1)[1]
    assert worker.endpoint == f"tcp://engine:{engine_port}"
    assert worker.replay_endpoint == f"tcp://engine:{replay_port}"
    assert settings.ranks == engine.ranks and settings.block_size == engine.block_size
    assert serve["ports"] == [f"{settings.port}:{settings.port}"]
    assert serve["depends_on"] == ["engine"]
    for service in services.values():  # built here, never pulled from a registry
        assert (
            ROOT / "deploy" / service["build"]["context"] / service["build"]["dockerfile"]
        ).samefile(DEPLOY / "Dockerfile")
