"""Settings of serve and publish: a TOML file, KVEVENTS_* variables and flags, in that order."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from kvevents.cli import build_parser
from kvevents.cli.common import UsageError
from kvevents.cli.config import (
    CONFIG_ENV,
    PolicyName,
    PublishSettings,
    ServeSettings,
    Settings,
    apply_settings,
    keys,
    resolve,
)
from kvevents.cli.serve import _registrations
from kvevents.index.router import DEFAULT_POLICY, POLICIES


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def write(tmp_path: Path, text: str, name: str = "kvevents.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def serve_settings(*argv: str, env: dict[str, str] | None = None) -> ServeSettings:
    return resolve(ServeSettings, "serve", parse("serve", *argv), env or {})


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


@pytest.mark.parametrize(
    ("command", "model"), [("serve", ServeSettings), ("publish", PublishSettings)]
)
def test_flags_and_model_keys_are_the_same_with_the_same_defaults(
    command: str, model: type[Settings]
) -> None:
    """Every flag is a settings key and every key a flag, defaulting alike (--help shows it)."""
    parser = _subparser(command)
    options = [a for a in parser._actions if a.dest != "help"]
    # Only tracked actions record that they were given: precedence depends on it.
    assert all(type(a).__name__ == "Given" for a in options)
    dests = {a.dest: a.default for a in options if a.dest != "config"}
    assert set(dests) == set(keys(model).values())
    fields = {alias: model.model_fields[name] for name, alias in keys(model).items()}
    for dest, flag_default in dests.items():
        assert flag_default == fields[dest].get_default(call_default_factory=True), dest


def test_policy_names_and_default_are_the_routers() -> None:
    """The settings' policy names are exactly the router's, its default the router's default."""
    assert set(typing.get_args(PolicyName)) == set(POLICIES)
    assert ServeSettings().policy == DEFAULT_POLICY


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    """Precedence key by key: flags > KVEVENTS_SERVE_* > [serve] in the file > defaults."""
    config = write(tmp_path, '[serve]\nport = 7001\nhost = "0.0.0.0"\nseed = 5\nload_ttl = 3\n')
    env = {"KVEVENTS_SERVE_PORT": "7002", "KVEVENTS_SERVE_SEED": "6"}
    settings = serve_settings("--config", config, "--seed", "7", env=env)
    assert (settings.host, settings.port, settings.seed) == ("0.0.0.0", 7002, 7)
    assert settings.load_ttl == 3.0  # the file's, as a float
    assert settings.block_size == 16  # the default


def test_a_flag_given_its_default_value_still_wins(tmp_path: Path) -> None:
    """``--port 8090`` is a choice, not an absence: it beats the file and the environment."""
    config = write(tmp_path, "[serve]\nport = 7001\n")
    settings = serve_settings(
        "--config", config, "--port", "8090", env={"KVEVENTS_SERVE_PORT": "7002"}
    )
    assert settings.port == 8090


def test_lists_replace_and_come_comma_separated_from_the_environment(tmp_path: Path) -> None:
    """A list from a later source replaces the earlier one; the environment splits on commas."""
    config = write(tmp_path, '[serve]\nallow_endpoint_host = ["10.0.0.0/8"]\n')
    assert serve_settings("--config", config).allow_endpoint_host == ["10.0.0.0/8"]
    env = {"KVEVENTS_SERVE_ALLOW_ENDPOINT_HOST": "127.0.0.1, ipc"}
    assert serve_settings("--config", config, env=env).allow_endpoint_host == ["127.0.0.1", "ipc"]
    flags = serve_settings("--config", config, "--allow-endpoint-host", "*", env=env)
    assert flags.allow_endpoint_host == ["*"]


def test_the_config_file_can_be_named_by_the_environment(tmp_path: Path) -> None:
    """$KVEVENTS_CONFIG names the file when --config is not given (for containers)."""
    config = write(tmp_path, '[serve]\npolicy = "prefix_load"\nprefill_weight = 2.5\n')
    settings = serve_settings(env={CONFIG_ENV: config})
    assert (settings.policy, settings.prefill_weight) == ("prefix_load", 2.5)


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path: Path) -> None:
    """``state_file = "state.json"`` means next to the config file, wherever serve runs."""
    config = write(tmp_path, '[serve]\nstate_file = "state.json"\nauth_token_file = "/abs/token"\n')
    settings = serve_settings("--config", config)
    assert settings.state_file == str(tmp_path / "state.json")
    assert settings.auth_token_file == "/abs/token"
    assert serve_settings("--state-file", "here.json").state_file == "here.json"


def test_workers_from_the_file_become_registrations(tmp_path: Path) -> None:
    """Worker entries give id, endpoints, ranks and block size, or take the service's."""
    config = write(
        tmp_path,
        """[serve]
ranks = 2
block_size = 32
[[serve.workers]]
id = "a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5600"
[[serve.workers]]
id = "b"
endpoint = "tcp://10.0.0.6:5557"
ranks = [0, 3]
block_size = 64
""",
    )
    regs = _registrations(serve_settings("--config", config, "--worker", "c=tcp://10.0.0.7:5557"))
    assert [(r.worker_id, r.ranks, r.block_size, r.replay_endpoint) for r in regs] == [
        ("c", (0, 1), 32, None)  # the flag's list replaced the file's
    ]
    regs = _registrations(serve_settings("--config", config))
    assert [(r.worker_id, r.endpoint, r.ranks, r.block_size, r.replay_endpoint) for r in regs] == [
        ("a", "tcp://10.0.0.5:5557", (0, 1), 32, "tcp://10.0.0.5:5600"),
        ("b", "tcp://10.0.0.6:5557", (0, 3), 64, None),
    ]


@pytest.mark.parametrize(
    ("toml", "env", "argv", "message"),
    [
        ('port = "8090"', {}, [], "kvevents.toml: [serve] port: Input should be a valid integer"),
        ("port = 70000", {}, [], "[serve] port: Input should be less than or equal to 65535"),
        ("prot = 1", {}, [], "kvevents.toml: [serve] prot: unknown key"),
        ('policy = "best"', {}, [], "[serve] policy: Input should be 'longest_prefix'"),
        ("load_ttl = 0", {}, [], "[serve] load_ttl: Input should be greater than 0"),
        ('[[serve.workers]]\nid = "a"\nendpoint = "nope"', {}, [], "[serve] workers[0].endpoint: endpoint 'nope'"),
        ('[[serve.workers]]\nendpoint = "tcp://127.0.0.1:1"', {}, [], "[serve] workers[0].id: Field required"),
        ('[[serve.workers]]\nid = "a"\nendpoint = "tcp://127.0.0.1:1"\nrank = 1', {}, [], "workers[0].rank: unknown key"),
        ("", {"KVEVENTS_SERVE_PORT": "eighty"}, [], "$KVEVENTS_SERVE_PORT: Input should be a valid integer"),
        ("", {"KVEVENTS_SERVE_LOAD_WEIGHT": "nan"}, [], "$KVEVENTS_SERVE_LOAD_WEIGHT: Input should be a finite number"),
        ("", {"KVEVENTS_SERVE_COLOUR": "red"}, [], "$KVEVENTS_SERVE_COLOUR: unknown key"),
        ("", {"KVEVENTS_SERVE_WORKERS": "a"}, [], "$KVEVENTS_SERVE_WORKERS: workers are set in the config file"),
        ("", {}, ["--prefill-weight", "-2"], "--prefill-weight: Input should be greater than or equal to 0"),
        ("", {}, ["--policy", "best"], "--policy: Input should be 'longest_prefix'"),
        ("", {}, ["--worker", "a=tcp://127.0.0.1:1", "--worker", "a=tcp://127.0.0.1:2"], "worker id 'a' is given twice"),
        ("", {}, ["--worker", "a:1=tcp://127.0.0.1:1"], "--worker: 'a:1=tcp://127.0.0.1:1': serve registers base endpoints"),
    ],
)  # fmt: skip
def test_errors_name_the_source_and_the_key(
    tmp_path: Path, toml: str, env: dict[str, str], argv: list[str], message: str
) -> None:
    """A bad value is refused with the file/variable/flag it came from, the key and the rule."""
    config = write(tmp_path, f"[serve]\n{toml}\n")
    with pytest.raises(UsageError) as caught:
        serve_settings("--config", config, *argv, env=env)
    assert message in str(caught.value)


def test_a_file_that_is_not_a_settings_file_is_refused(tmp_path: Path) -> None:
    """Unreadable, not TOML, or keys outside [serve]/[publish]: an error naming the file."""
    with pytest.raises(UsageError, match=r"--config .*missing\.toml: No such file"):
        serve_settings("--config", str(tmp_path / "missing.toml"))
    with pytest.raises(UsageError, match=r"bad\.toml: not valid TOML"):
        serve_settings("--config", write(tmp_path, "[serve\n", "bad.toml"))
    with pytest.raises(
        UsageError, match=r"top.toml: 'port': expected a \[serve\], \[publish\] or \[route\]"
    ):
        serve_settings("--config", write(tmp_path, "port = 1\n", "top.toml"))


def test_one_file_holds_both_commands(tmp_path: Path) -> None:
    """serve reads [serve] and publish reads [publish] from the same file."""
    config = write(tmp_path, "[serve]\nport = 7001\n[publish]\nrate = 50.0\njson = true\n")
    publish = resolve(PublishSettings, "publish", parse("publish", "--config", config), {})
    assert (publish.rate, publish.json_lines) == (50.0, True)
    assert serve_settings("--config", config).port == 7001


def test_publish_runs_from_a_config_file(tmp_path: Path) -> None:
    """End to end: publish binds where its file says and stops after the file's count."""
    config = write(
        tmp_path,
        '[publish]\nendpoint = "tcp://127.0.0.1:0"\nreplay_endpoint = "none"\n'
        "rate = 200.0\ncount = 2\njson = true\n",
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "publish", "--config", config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines: list[dict[str, Any]] = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0]["type"] == "ready"
    assert lines[0]["ranks"][0]["endpoint"].startswith("tcp://127.0.0.1:")
    assert lines[0]["ranks"][0]["replay_endpoint"] is None
    assert lines[-1]["type"] == "summary" and lines[-1]["batches"] >= 2


def test_the_documented_example_file_is_valid(tmp_path: Path) -> None:
    """The TOML example of docs/cli.md is accepted as written, for serve and for publish."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    config = write(tmp_path, example)
    settings = serve_settings("--config", config)
    assert [w.id for w in settings.workers] == ["engine-0"]
    assert settings.state_file == str(tmp_path / "state.json")
    assert _registrations(settings)[0].ranks == (0, 1)
    publish = resolve(PublishSettings, "publish", parse("publish", "--config", config), {})
    assert publish.rate == 50.0


def test_the_send_timeout_comes_from_a_flag_or_the_file(tmp_path: Path) -> None:
    """``--send-timeout`` and ``send_timeout`` in [serve] set the HTTP limit of that name
    (30 s when neither is given); the other limits keep theirs."""
    from kvevents.cli.serve import _app_options

    def limits(*argv: str) -> Any:
        return _app_options(
            apply_settings(ServeSettings, "serve", parse("serve", *argv), {})
        ).limits

    assert limits().send_timeout == 30.0
    assert limits("--send-timeout", "2.5").send_timeout == 2.5
    config = write(tmp_path, "[serve]\nsend_timeout = 4\nheader_timeout = 3\n")
    from_file = limits("--config", config)
    assert (from_file.send_timeout, from_file.header_timeout) == (4.0, 3.0)
    assert limits("--config", config, "--send-timeout", "1").send_timeout == 1.0
    with pytest.raises(UsageError, match="send_timeout"):
        serve_settings("--config", write(tmp_path, "[serve]\nsend_timeout = 0\n", "bad.toml"))
