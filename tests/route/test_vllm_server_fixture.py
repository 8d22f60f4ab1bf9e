"""The vLLM server fixture's own parts that need no engine: ports, metrics, the command line."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from kvevents.testing.vllm_server import VllmServer, free_port, parse_metrics


def test_free_ports_are_free_and_never_handed_out_twice() -> None:
    """Each base has its span free, and no port is given twice in one process."""
    seen: set[int] = set()
    for _ in range(20):
        base = free_port(3)
        span = set(range(base, base + 3))
        assert seen.isdisjoint(span)
        seen |= span
        for port in span:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))


def test_parse_metrics_sums_each_sample_over_its_labels() -> None:
    """Prometheus text: comments and broken lines skipped, each name summed over label sets."""
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0\n'
        "vllm:num_requests_running 2\n"
        "bad line\n"
    )
    assert parse_metrics(text) == {
        "vllm:prefix_cache_hits_total": 100.0,
        "vllm:num_requests_running": 2.0,
    }


def test_the_command_line_has_what_a_front_door_needs(tmp_path: Path) -> None:
    """Prefix caching, prompt token details, events with replay, the cache size; the tokenizer
    is skipped only when the model directory has none."""
    server = VllmServer("python", tmp_path, block_size=32, num_blocks=10, topic="kv", ranks=2)
    server.port, server.event_port, server.replay_port = 8000, 5557, 5600
    command = server.command()
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in command
    assert command[command.index("--max-model-len") + 1] == str(9 * 32)
    assert command[command.index("--num-gpu-blocks-override") + 1] == "10"
    assert command[command.index("--data-parallel-size") + 1] == "2"
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["topic"] == "kv" and events["replay_endpoint"] == "tcp://*:5600"
    assert "--skip-tokenizer-init" in command
    (tmp_path / "tokenizer.json").write_text("{}")
    assert "--skip-tokenizer-init" not in server.command()
    assert server.event_endpoint(1) == "tcp://127.0.0.1:5558"
