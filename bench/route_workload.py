"""The two workloads of ``bench_route``, written as input files for the benchmark client (aiperf).

- **chat**: several "apps", each with a long system prompt of its own; many conversations
  (each belongs to one app) of several turns; the client replays them at a fixed concurrency,
  each later turn carrying the whole history, the engine's own answers included (aiperf's
  ``multi_turn`` input: user turns only, the assistant turns are what the engine said).
- **mooncake**: the bundled Mooncake trace's shape (``kvevents/sim/data``): whole prefix groups
  (rows sharing their first hash id) sampled from the trace, each 512-token block of the
  original scaled down to one engine block, lengths capped; aiperf's ``mooncake_trace`` input
  turns every hash id into the same text wherever it occurs, so shared ids are shared prefixes.

Sizes are in tokens of the engines' tokenizer. :func:`chat_working_set_blocks` and
:func:`mooncake_working_set_blocks` give the blocks a cache needs to hold the working set; the
rig sizes each engine's cache to a third of it (``bench_route``).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevents.sim import default_trace_path

#: Tokens the chat template adds per message (``<|im_start|>role\n`` ... ``<|im_end|>\n``).
TEMPLATE_TOKENS_PER_MESSAGE = 5

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part cache token prefix "
    "engine router request model block hash event stream replay"
)
_WORDS = tuple(_WORD_TEXT.split())


class TextMaker:
    """Text of about ``n`` tokens of the engines' tokenizer, from seeded English-like words."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def count(self, text: str) -> int:
        """Tokens of ``text`` (no special tokens)."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, tokens: int, rng: random.Random, lead: str = "") -> str:
        """Words until the text has at least ``tokens`` tokens, then trimmed to at most that."""
        words = lead.split()
        while self.count(" ".join(words)) < tokens:
            words += [rng.choice(_WORDS) for _ in range(max(8, (tokens - len(words)) // 2))]
        low, high = 0, len(words)  # the longest prefix of words within the budget
        while low < high:
            mid = (low + high + 1) // 2
            if self.count(" ".join(words[:mid])) <= tokens:
                low = mid
            else:
                high = mid - 1
        return " ".join(words[:low])


@dataclass(frozen=True)
class ChatShape:
    """The multi-turn chat workload: apps, conversations, turns, and the client's concurrency."""

    apps: int = 6
    system_tokens: int = 1024
    conversations: int = 96
    turns: int = 4
    user_tokens: int = 64
    answer_tokens: int = 32
    concurrency: int = 9
    seed: int = 25

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def history_tokens(self) -> int:
        """The longest prompt: system prompt, every turn's question and answer, the last question."""
        per_turn = self.user_tokens + self.answer_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE
        return self.system_tokens + TEMPLATE_TOKENS_PER_MESSAGE + 1 + self.turns * per_turn


def chat_working_set_blocks(shape: ChatShape, block_size: int) -> int:
    """Blocks to hold every app's system prompt and the live conversations' own histories."""
    system = shape.apps * math.ceil(
        (shape.system_tokens + TEMPLATE_TOKENS_PER_MESSAGE) / block_size
    )
    private = shape.history_tokens() - shape.system_tokens
    return system + shape.concurrency * math.ceil(private / block_size)


def chat_records(shape: ChatShape, maker: TextMaker) -> list[dict[str, Any]]:
    """aiperf ``multi_turn`` records: a system turn, then user turns with their answer length.

    Conversations are assigned to apps at random (seeded), so the client's interleaving of
    concurrent conversations mixes apps as real traffic does.
    """
    rng = random.Random(shape.seed)
    systems = [
        maker.text(shape.system_tokens, rng, lead=f"You are assistant number {app}.")
        for app in range(shape.apps)
    ]
    records = []
    for conversation in range(shape.conversations):
        app = rng.randrange(shape.apps)
        turns: list[dict[str, Any]] = [{"role": "system", "text": systems[app]}]
        for turn in range(shape.turns):
            lead = f"Conversation {conversation} question {turn}:"
            question = maker.text(shape.user_tokens, rng, lead=lead)
            turns.append({"text": question, "output_length": shape.answer_tokens})
        records.append({"session_id": f"app{app}-conv{conversation}", "turns": turns})
    return records


@dataclass(frozen=True)
class MooncakeShape:
    """The Mooncake trace, scaled: prefix groups sampled, one engine block per 512-token block."""

    # 25 of the trace's prefix groups (150 rows): an LRU cache of the pooled engine's size
    # would serve 0.71 of their blocks, one of a third that size 0.35 (route_workload's
    # lru_hit_fraction), so which engine a row goes to matters.
    groups: int = 25
    max_blocks: int = 32
    output_tokens: int = 16
    concurrency: int = 9
    seed: int = 25
    #: Rows of the trace considered (its start: arrival order kept).
    window: int = 4000

    def trace_rows(self) -> list[dict[str, Any]]:
        """The sampled rows in arrival order (the bundled trace, whole prefix groups)."""
        rows = _read_trace(Path(default_trace_path()))[: self.window]
        by_group: dict[int, list[dict[str, Any]]] = OrderedDict()
        for row in rows:
            by_group.setdefault(row["hash_ids"][0], []).append(row)
        shared = [group for group, members in by_group.items() if len(members) > 1]
        rng = random.Random(self.seed)
        chosen = set(rng.sample(shared, min(self.groups, len(shared))))
        return [row for row in rows if row["hash_ids"][0] in chosen]


def _read_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def mooncake_records(shape: MooncakeShape, block_size: int) -> list[dict[str, Any]]:
    """aiperf ``mooncake_trace`` records: hash ids (capped), every block full, capped output.

    No timestamps: the client sends at a fixed concurrency (closed loop), not on the trace's
    clock, so that one router's run takes the same few minutes whatever its speed.
    """
    records = []
    for row in shape.trace_rows():
        ids = row["hash_ids"][: shape.max_blocks]
        records.append(
            {
                "input_length": len(ids) * block_size,
                "output_length": max(1, min(row["output_length"], shape.output_tokens)),
                "hash_ids": ids,
            }
        )
    return records


def mooncake_working_set_blocks(records: Sequence[dict[str, Any]]) -> int:
    """Distinct blocks of the sampled rows that some later row reuses (what a cache could serve).

    Blocks nobody reuses need no room beyond the request in flight, so they are not counted;
    the rest is what a cache must hold for every reuse to hit.
    """
    seen: set[int] = set()
    reused: set[int] = set()
    for record in records:
        ids = record["hash_ids"]
        reused.update(i for i in ids if i in seen)
        seen.update(ids)
    return len(reused)


def lru_hit_fraction(prompts: Iterable[Sequence[int]], capacity: int) -> float:
    """Fraction of blocks a single LRU cache of ``capacity`` blocks serves (prefix hits only).

    A yardstick for sizing, not a model of vLLM: sequential, no requests in flight.
    """
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits = total = 0
    for blocks in prompts:
        total += len(blocks)
        matching = True
        for depth in range(1, len(blocks) + 1):
            key = tuple(blocks[:depth])
            if matching and key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                matching = False
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total if total else 0.0


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path
