"""A real vLLM engine (CPU build) stepped one scheduler step at a time; run by vLLM's interpreter.

This file is not a test module: ``tests/interop/test_vllm_sim.py`` runs it with the
interpreter of ``.venv-vllm`` and holds the simulated engine to what it records.

argv[1] is a JSON object: ``model_dir``, ``block_size``, ``num_blocks``,
``max_num_batched_tokens``, ``max_num_seqs`` and ``workloads``, each ``{"seed", "apps",
"system_tokens", "conversations", "turns", "user_tokens", "answer_tokens", "concurrency"}``:
multi-turn chats over per-app system prompts, run closed loop (``concurrency`` conversations
at once, a conversation's next turn added right after its previous answer, before the next
step). A turn's prompt is the previous prompt, a filler answer of ``answer_tokens`` (not the
engine's answer, which no later prompt contains, as a re-tokenized real answer often does not)
and the new user tokens.

For each workload the script writes one JSON line: ``requests`` (id -> prompt, output length,
cached tokens as vLLM reports them) and ``steps`` (per engine step: the requests added before
it, the requests it finished, and then the block pool's free blocks, its cached block hashes,
the running and waiting requests). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that its scheduler can be read after every step.
vLLM's logs go to stderr; stdout carries only the JSON lines.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from vllm_engine import build_model


def start_engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=spec["model_dir"],
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=spec["block_size"],
        num_gpu_blocks_override=spec["num_blocks"],
        max_model_len=(spec["num_blocks"] - 1) * spec["block_size"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        gpu_memory_utilization=0.1,
        dtype="float32",
        seed=0,
    )


def conversations(work: dict[str, Any]) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user turns) per conversation; tokens below the tiny model's 1024."""
    rng = random.Random(work["seed"])
    systems = [
        [rng.randrange(16, 1000) for _ in range(work["system_tokens"])] for _ in range(work["apps"])
    ]
    made = []
    for _ in range(work["conversations"]):
        system = systems[rng.randrange(work["apps"])]
        turns = [
            [rng.randrange(16, 1000) for _ in range(work["user_tokens"])]
            for _ in range(work["turns"])
        ]
        made.append((system, turns))
    return made


def run(llm: Any, work: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    if not pool.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    params = SamplingParams(max_tokens=work["answer_tokens"], ignore_eos=True, temperature=0.0)
    filler = [7] * work["answer_tokens"]
    pending = list(enumerate(conversations(work)))
    history: dict[int, tuple[list[list[int]], int, list[int]]] = {}
    due: list[int] = []
    requests: dict[str, dict[str, Any]] = {}
    steps: list[dict[str, Any]] = []

    def start_next() -> None:
        if pending:
            number, (system, turns) = pending.pop(0)
            history[number] = (turns, 0, list(system))
            due.append(number)

    for _ in range(work["concurrency"]):
        start_next()
    while due or engine.has_unfinished_requests():
        added = []
        for number in due:
            turns, turn, before = history[number]
            prompt = before + turns[turn]
            request_id = f"c{number}/{turn}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            requests[request_id] = {"prompt": prompt}
            added.append(request_id)
        due = []
        finished = []
        for output in engine.step():
            if not output.finished:
                continue
            request_id = output.request_id
            record = requests[request_id]
            record["output_tokens"] = len(output.outputs[0].token_ids)
            record["cached"] = output.num_cached_tokens
            finished.append(request_id)
            number, turn = int(request_id[1:].split("/")[0]), int(request_id.split("/")[1])
            turns, _, _ = history[number]
            if turn + 1 < len(turns):
                history[number] = (turns, turn + 1, record["prompt"] + filler)
                due.append(number)
            else:
                start_next()
        steps.append(
            {
                "added": added,
                "finished": finished,
                "free": pool.get_num_free_blocks(),
                "cached": len(pool.cached_block_hash_to_block),
                "running": len(scheduler.running),
                "waiting": len(scheduler.waiting),
            }
        )
    return {"requests": requests, "steps": steps}


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's log handlers write to fd 1: send them to stderr
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    build_model(Path(spec["model_dir"]))
    llm = start_engine(spec)
    for work in spec["workloads"]:
        out.write(json.dumps(run(llm, work)) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
