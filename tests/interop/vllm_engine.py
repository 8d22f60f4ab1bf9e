"""A real vLLM engine (CPU build) behind a line-based JSON protocol; run by vLLM's interpreter.

This file is not a test module: ``tests/interop/test_vllm.py`` starts it with the interpreter
of ``.venv-vllm`` (vLLM's dependencies clash with ours) and talks to it over stdin/stdout:

- ``--build-model DIR`` only saves the model (for a server started otherwise);
- argv[1]: a JSON object: ``model_dir``, ``block_size``, ``num_blocks``, ``endpoint``,
  ``replay_endpoint``, ``topic``, optional ``publisher`` (default ``"zmq"``) and
  ``engine_args`` (more ``vllm.LLM`` keyword arguments);
- the script writes ``{"ready": true, "publisher": module, "publisher_class": name, ...}``
  once the engine serves, then answers each request
  line with one reply line:
  ``{"op": "generate", "prompt": [ids], "cache_salt": str | null}`` ->
  ``{"cached": num_cached_tokens, "published": batches the engine's publisher has sent}``;
  ``{"op": "reset"}`` -> ``{"reset": bool, "published": n}``;
  ``{"op": "load", "seconds": s, "seed": n, "alternate": {endpoints} | null}`` ->
  ``{"steps": [[publisher index, seconds] per engine step], "gc": [[publisher index,
  seconds] per full garbage collection], "requests": n}``
  (``bench/bench_vllm.py``: continuous load, two publishers taking turns);
  ``{"op": "quit"}`` -> exit 0.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that after a
request the script can wait until vLLM's publisher thread has sent every batch of it, and
report how many it sent: the test then waits for our subscriber to have delivered exactly
that many, instead of sleeping. vLLM's own logs are moved to stderr so stdout carries only
the protocol.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Tiny Llama: CPU attention wants head_dim 64 (16 is unsupported), the rest is kept minimal.
_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}
_FLUSH_TIMEOUT = 10.0


def build_model(directory: Path) -> None:
    """Save a Llama with random weights (seeded) into ``directory``; no download."""
    if (directory / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_MODEL)).save_pretrained(directory)


def start_engine(spec: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` with prefix caching and KV events, on a cache of ``num_blocks`` blocks."""
    from vllm import LLM

    events = {
        "enable_kv_cache_events": True,
        "publisher": spec.get("publisher", "zmq"),
        "endpoint": spec["endpoint"],
        "replay_endpoint": spec["replay_endpoint"],
        "topic": spec.get("topic", ""),
    }
    args: dict[str, Any] = {
        "model": spec["model_dir"],
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "block_size": spec["block_size"],
        "gpu_memory_utilization": 0.1,
        "num_gpu_blocks_override": spec["num_blocks"],
        # vLLM refuses a model length the cache cannot hold (one block is its null block).
        "max_model_len": (spec["num_blocks"] - 1) * spec["block_size"],
        "max_num_seqs": 4,
        "dtype": "float32",
        "seed": 0,
        "kv_events_config": events,
    }
    return LLM(**{**args, **spec.get("engine_args", {})})


def publisher_of(llm: Any) -> Any:
    """The scheduler's event publisher (in this process: multiprocessing is off)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher


def published(llm: Any) -> int:
    """Batches the publisher has sent, once its queue is drained (bounded wait)."""
    publisher = publisher_of(llm)
    queue = getattr(publisher, "_event_queue", None)
    if queue is None:  # a publisher of another kind keeps its own count
        return int(publisher.published_batches())
    deadline = time.monotonic() + _FLUSH_TIMEOUT
    # unfinished_tasks drops only after the batch was sent and kept for replay.
    while queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.002)
    buffer = publisher._buffer
    return buffer[-1][0] + 1 if buffer else 0


def generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One prompt, one output token: what vLLM served from its prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=request["prompt"])
    if request.get("cache_salt") is not None:
        prompt["cache_salt"] = request["cache_salt"]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return {"cached": output.num_cached_tokens, "published": published(llm)}


def load(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Keep the engine busy for ``seconds``: rounds of 32 prompts of 64-600 random tokens.

    One output token each, so every step is a prefill step (stores and, once the cache is
    full, evictions). With ``alternate`` (the endpoints of a second publisher: kvevents'
    plugin) the scheduler's publisher is swapped between rounds, so both publishers see the
    same engine, prompts and machine load. Every engine step is timed, with the index of the
    publisher in use.
    """
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    publishers = [scheduler.kv_event_publisher]
    if request.get("alternate"):
        from kvevents.integrations.vllm import VllmPublisher

        publishers.append(VllmPublisher(0, **request["alternate"]))
    steps: list[tuple[int, float]] = []
    step, current = core.step_fn, 0

    def timed() -> Any:
        start = time.perf_counter()
        try:
            return step()
        finally:
            steps.append((current, time.perf_counter() - start))

    core.step_fn = timed
    collections: list[tuple[int, float]] = []  # full (generation 2) collections
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collections.append((current, time.perf_counter() - gc_started[0]))

    gc.callbacks.append(on_gc)
    rng = random.Random(request.get("seed", 0))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    deadline = time.monotonic() + float(request["seconds"])
    requests = 0
    try:
        while time.monotonic() < deadline:
            scheduler.kv_event_publisher = publishers[current]
            prompts = [
                TokensPrompt(prompt_token_ids=[rng.randrange(1, 1024) for _ in range(n)])
                for n in (rng.randrange(64, 601) for _ in range(32))
            ]
            llm.generate(prompts, params, use_tqdm=False)
            requests += len(prompts)
            current = (current + 1) % len(publishers)
    finally:
        gc.callbacks.remove(on_gc)
        core.step_fn = step
        scheduler.kv_event_publisher = publishers[0]
        for extra in publishers[1:]:
            extra.shutdown()
    kvevents = sys.modules.get("kvevents")
    loaded = getattr(kvevents, "__file__", None)
    return {"steps": steps, "gc": collections, "requests": requests, "kvevents": loaded}


def serve(llm: Any, out: Any) -> None:
    """Answer request lines from stdin until ``quit`` or EOF."""
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            return
        if request["op"] == "generate":
            reply = generate(llm, request)
        elif request["op"] == "load":
            reply = load(llm, request)
        elif request["op"] == "reset":
            reply = {"reset": bool(llm.reset_prefix_cache()), "published": published(llm)}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    if sys.argv[1] == "--build-model":
        build_model(Path(sys.argv[2]))
        return
    spec = json.loads(sys.argv[1])
    # The protocol gets its own copy of stdout; fd 1 (vLLM's log handlers) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    build_model(Path(spec["model_dir"]))
    llm = start_engine(spec)
    kind = type(publisher_of(llm))
    ready = {"ready": True, "published": published(llm), "publisher": kind.__module__}
    kvevents = sys.modules.get("kvevents")  # the plugin's, when vLLM loaded it
    ready["kvevents"] = getattr(kvevents, "__file__", None)
    out.write(json.dumps({**ready, "publisher_class": kind.__qualname__}) + "\n")
    out.flush()
    serve(llm, out)


if __name__ == "__main__":
    main()
