"""``make demo-route``: ``kvevents route`` in front of two real vLLM CPU engines, live.

Builds the tiny chat model (a real tokenizer and chat template; seconds), starts two vLLM
OpenAI servers with KV events (about a minute), puts the front door in front of them, and
runs a few multi-turn conversations through the ``openai`` client, printing for every
request the engine it went to, the cached tokens the front door predicted and those the
engine reported. Needs vLLM's CPU build in ``.venv-vllm`` (``make vllm``).

``python -m kvevents.testing.route_demo [--conversations N] [--turns N]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvevents.route._frontdoor import EngineSpec, FrontDoor
from kvevents.route._plan import PlannerOptions
from kvevents.route._tokens import ModelTokenizer
from kvevents.testing.vllm_server import (
    VllmServer,
    build_chat_model,
    find_vllm_python,
    start_servers,
    vllm_unavailable,
)

BLOCK = 32
SYSTEM = "You are the demo assistant of kvevents. Keep every answer short and to the point. " * 6


def _conversations(door: FrontDoor, model: str, count: int, turns: int) -> tuple[int, int]:
    import openai

    client = openai.OpenAI(base_url=f"{door.url}/v1", api_key="none", max_retries=0)
    exact = total = 0
    print(f"{'conv':>4} {'turn':>4}  {'engine':<8} {'prompt':>6} {'predicted':>9} {'cached':>6}")
    for n in range(count):
        messages = [{"role": "system", "content": f"{SYSTEM} Conversation {n}."}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {n}?"})
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                # Plain role/content dicts: the client's TypedDicts are these at run time.
                messages=messages,  # type: ignore[arg-type]
                max_tokens=16,
            )
            reply = raw.parse()
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            predicted = int(raw.headers["x-kvevents-predicted-cached-tokens"])
            cached = usage.prompt_tokens_details.cached_tokens or 0
            exact += predicted == cached
            total += 1
            engine = raw.headers["x-kvevents-engine"]
            print(
                f"{n:>4} {turn:>4}  {engine:<8} {usage.prompt_tokens:>6} {predicted:>9} {cached:>6}"
            )
            messages.append(
                {"role": "assistant", "content": reply.choices[0].message.content or ""}
            )
    return exact, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvevents.testing.route_demo")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args(argv)
    why = vllm_unavailable()
    python = find_vllm_python()
    if why is not None or python is None:
        print(f"the demo needs vLLM's CPU build: {why} (make vllm)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvevents-route-demo-") as work:
        print("building the tiny chat model and starting two vLLM engines (about a minute)...")
        model_dir = build_chat_model(python, Path(work) / "model")
        servers = start_servers(
            VllmServer(python, model_dir, block_size=BLOCK, num_blocks=256, log_dir=Path(work))
            for _ in range(2)
        )
        try:
            specs = [
                EngineSpec(
                    s.url, f"e{i}", s.event_endpoint(), s.replay_endpoint(), block_size=BLOCK
                )
                for i, s in enumerate(servers)
            ]
            tokenizer = ModelTokenizer.load(model_dir, model_name=servers[0].model)
            options = PlannerOptions(block_size=BLOCK)
            with FrontDoor(specs, {None: tokenizer}, planner_options=options) as door:
                print(f"kvevents route on {door.url} (status page: {door.url}/)\n")
                exact, total = _conversations(
                    door, servers[0].model, args.conversations, args.turns
                )
        finally:
            for server in servers:
                server.close()
    print(f"\npredicted == cached on {exact} of {total} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
