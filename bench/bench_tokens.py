"""The front door's tokenization cost per request, by prompt length, against the bare encode.

``ModelTokenizer`` (kvevents.route) on the tiny chat model's tokenizer (a trained byte-level
BPE of 4,100 tokens with a ChatML template; kvevents.testing.chat_model), for prompts of about
128, 1k and 8k tokens:

- single-turn chat: a system prompt and one new user message (its text never seen before);
- multi-turn chat: the 8th turn of a conversation whose 7 earlier turns the router has seen
  (each message about a sixteenth of the prompt), as a router sees a conversation;
- completion: a new text prompt.

Each figure is the median time of one request (render + encode, or encode), with, in the same
run, the bare ``tokenizer(text)`` of the same text (the rendered chat for chats) as baseline:
the least any exact in-process tokenizer pays. Needs the ``route`` extra.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness import Row, median

LENGTHS = (128, 1024, 8192)
REQUESTS = 40
WORDS = [
    "the",
    "cache",
    "prefix",
    "engine",
    "router",
    "token",
    "model",
    "block",
    "hash",
    "event",
    "stream",
    "replay",
    "request",
    "hello",
    "world",
    "again",
    "please",
    "answer",
    "briefly",
    "think",
    "about",
    "it",
    "carefully",
    "now",
]
SYSTEM = "You are a helpful assistant for the kvevents front door. Answer briefly."


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of new text (two tokens a word on this vocabulary)."""
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(tokens // 3))


def paired(
    ours: Sequence[Callable[[], Any]], bare: Sequence[Callable[[], Any]]
) -> tuple[float, float]:
    """Median microseconds of each list, timed in turns (call i of one, then of the other) so
    that a busy machine slows both alike."""
    samples: tuple[list[float], list[float]] = ([], [])
    for pair in zip(ours, bare, strict=True):
        for side, call in zip(samples, pair, strict=True):
            start = time.perf_counter_ns()
            call()
            side.append((time.perf_counter_ns() - start) / 1000)
    return median(samples[0]), median(samples[1])


def single_turn(rng: random.Random, length: int, model: str) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text(rng, length)},
            ],
        }
        for _ in range(REQUESTS)
    ]


def conversation(rng: random.Random, length: int, model: str) -> list[dict[str, Any]]:
    """The bodies of one conversation's 8 turns; the last one is about ``length`` tokens."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    bodies = []
    for turn in range(8):
        messages.append({"role": "user", "content": text(rng, max(3, length // 16 - 8))})
        bodies.append({"model": model, "messages": list(messages)})
        if turn < 7:
            messages.append({"role": "assistant", "content": text(rng, max(3, length // 16 - 8))})
    return bodies


def run() -> list[Row]:
    try:
        from kvevents.route import ModelTokenizer
        from kvevents.testing.chat_model import build_tokenizer
    except ImportError as exc:  # the route extra is not installed
        print(f"skipped: {exc}")
        return []
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = ModelTokenizer.load(build_tokenizer(Path(directory)), model_name="tiny")
        return _rows(tokenizer)


def _chat_row(tokenizer: Any, section: str, case: str, bodies: list[dict[str, Any]]) -> Row:
    texts = [tokenizer.render(body)[0] for body in bodies]
    size = len(tokenizer.encode(texts[0], add_special_tokens=False))
    ours, bare = paired(
        [lambda b=body: tokenizer.chat(b) for body in bodies],
        [lambda t=text: tokenizer.tokenizer(t, add_special_tokens=False) for text in texts],
    )
    return Row(section, f"{case} ({size} tokens)", "latency p50", ours, "us", bare, "bare encode")


def _completion_row(tokenizer: Any, section: str, bodies: list[dict[str, Any]]) -> Row:
    size = len(tokenizer.encode(bodies[0]["prompt"], add_special_tokens=True))
    ours, bare = paired(
        [lambda b=body: tokenizer.completion(b) for body in bodies],
        [lambda b=body: tokenizer.tokenizer(b["prompt"]) for body in bodies],
    )
    return Row(
        section, f"completion ({size} tokens)", "latency p50", ours, "us", bare, "bare encode"
    )


def _rows(tokenizer: Any) -> list[Row]:
    rng = random.Random(7)
    rows: list[Row] = []
    for length in LENGTHS:
        section = f"tokens per request: {length:,}-token prompts"
        # New texts every request: no piece of the user message was seen before.
        rows.append(
            _chat_row(tokenizer, section, "single-turn chat", single_turn(rng, length, "tiny"))
        )
        last_turns = []
        for _ in range(REQUESTS):
            *earlier, last = conversation(rng, length, "tiny")
            for body in earlier:  # the router saw the conversation's earlier turns
                tokenizer.chat(body)
            last_turns.append(last)
        rows.append(_chat_row(tokenizer, section, "multi-turn chat, 8th turn", last_turns))
        prompts = [{"model": "tiny", "prompt": text(rng, length)} for _ in range(REQUESTS)]
        rows.append(_completion_row(tokenizer, section, prompts))
    return rows


if __name__ == "__main__":
    from run import render

    print(render(run(), "# Tokenization cost per request"))
