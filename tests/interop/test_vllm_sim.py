"""The simulated engine held to a real vLLM CPU engine, step by step.

``vllm_stepper.py`` runs closed-loop multi-turn chats on vLLM's engine one scheduler step at a
time, on a cache small enough that eviction, chunked prefill and preemption all happen, and
records what was added before each step, what it finished, and the block pool and queues after
it. The same requests are given to ``SimulatedEngine`` before the same steps: every request's
cached tokens, and after every step the finished requests, the blocks in use, the cached
blocks and the running and waiting requests, must be vLLM's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from vllm_peer import our_path

from kvevents.sim import EngineConfig, Request, SimulatedEngine

pytestmark = [pytest.mark.interop, pytest.mark.vllm, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("vllm_stepper.py")
BLOCK = 32
NUM_BLOCKS = 40  # 39 usable: vLLM keeps one as its null block
BUDGET = 256  # prompts of 264-500 tokens take two or more chunks
SEQS = 8
CHAT = {
    "apps": 3,
    "system_tokens": 256,
    "conversations": 12,
    "turns": 4,
    "user_tokens": 48,
    "answer_tokens": 16,
}
WORKLOADS = [
    {**CHAT, "seed": 1, "concurrency": 3},
    # Long answers, more conversations at once than the cache holds: decode preempts.
    {**CHAT, "seed": 2, "concurrency": 6, "answer_tokens": 96},
]
RUN_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def runs(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What the real engine did on each workload."""
    spec = {
        "model_dir": str(tmp_path_factory.mktemp("model")),
        "block_size": BLOCK,
        "num_blocks": NUM_BLOCKS,
        "max_num_batched_tokens": BUDGET,
        "max_num_seqs": SEQS,
        "workloads": WORKLOADS,
    }
    log = tmp_path_factory.mktemp("stepper") / "vllm.log"
    with log.open("wb") as stderr:
        done = subprocess.run(
            [vllm_python, str(SCRIPT), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            timeout=RUN_TIMEOUT,
            check=False,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **our_path()},
        )
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    assert done.returncode == 0, f"vllm_stepper.py failed:\n{tail}"
    lines = done.stdout.decode().splitlines()
    assert len(lines) == len(WORKLOADS), tail
    return [json.loads(line) for line in lines]


def replay(run: dict[str, Any]) -> tuple[SimulatedEngine, dict[str, int], list[dict[str, Any]]]:
    """The real run's requests through a simulated engine of the same shape, step by step."""
    config = EngineConfig(
        block_size=BLOCK,
        capacity_blocks=NUM_BLOCKS - 1,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=SEQS,
    )
    engine = SimulatedEngine(config)
    requests = run["requests"]
    steps = []
    for real in run["steps"]:
        for request_id in real["added"]:
            made = requests[request_id]
            engine.submit(Request(request_id, made["prompt"], made["output_tokens"]), rank=0)
        finished = engine.step().finished
        load = engine.load(0)
        steps.append(
            {
                "added": real["added"],
                "finished": finished,
                "free": config.capacity_blocks - load.active_blocks,
                "cached": load.cached_blocks,
                "running": load.running_requests,
                "waiting": load.waiting_requests,
            }
        )
    cached = {r.request_id: r.cached_tokens for r in engine.finished_requests}
    return engine, cached, steps


@pytest.mark.parametrize("workload", range(len(WORKLOADS)))
def test_simulated_engine_steps_as_vllm_does(runs: list[dict[str, Any]], workload: int) -> None:
    """Each request's cached tokens, and the engine's blocks and queues after every step."""
    run = runs[workload]
    engine, cached, steps = replay(run)
    assert not engine.has_work()
    real_cached = {request_id: r["cached"] for request_id, r in run["requests"].items()}
    assert cached == real_cached
    differing = [
        (i, real, sim)
        for i, (real, sim) in enumerate(zip(run["steps"], steps, strict=True))
        if real != sim
    ]
    assert differing[:3] == [], f"{len(differing)} of {len(steps)} steps differ"
    assert sum(real_cached.values()) > 0  # the cache was exercised
    if workload == 1:
        assert engine.metrics().preemptions > 0
