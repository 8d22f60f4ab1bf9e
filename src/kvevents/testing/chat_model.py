"""A tiny chat model built locally: a real byte-level BPE tokenizer, a chat template, random weights.

For tests that need an engine to tokenize and render chats the way it does for a real model,
without downloading one. Everything is deterministic (seeded corpus, seeded weights):

- :func:`build_tokenizer` trains a byte-level BPE (``tokenizers``) on a generated corpus of
  English-like words, code, JSON and text in many scripts (CJK, Arabic, Hebrew, Devanagari,
  emoji, combining marks); every byte has a token, so any unicode text encodes. It is saved with
  ``transformers.PreTrainedTokenizerFast.save_pretrained`` with ChatML-like special tokens
  (``<|im_start|>``, ``<|im_end|>``, a BOS ``<|bos|>`` that ``add_special_tokens`` prepends),
  plain added tokens (``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``), an NFC
  normalizer, and :data:`CHAT_TEMPLATE`. Needs only ``tokenizers`` and ``transformers``.
- :func:`build_model` adds a Llama config whose vocabulary covers the tokenizer and random
  weights; it needs ``torch``, so run it with an engine's interpreter:
  ``python -m kvevents.testing.chat_model DIR`` (vLLM's venv has torch; ours does not).

Both return at once when the directory already holds what they build.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ADDED_TOKENS",
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "OPENAI_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "build_tokenizer",
    "corpus",
    "main",
]

BOS = "<|bos|>"
EOS = "<|im_end|>"
#: Special tokens (``skip_special_tokens`` drops them), in id order after the trained vocabulary.
SPECIAL_TOKENS = (BOS, "<|im_start|>", EOS, "<|endoftext|>")
#: Added tokens that are not special: matched whole in text, kept when decoding.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
#: Size of the trained vocabulary (256 byte tokens, merges, the special tokens).
VOCAB_SIZE = 4096
_SEED = 20240601
_CORPUS_LINES = 6000

# ChatML with what real templates do: a BOS, system prompt handling, tools as JSON (tojson),
# tool calls and tool results, reasoning kept for the last assistant turn, a template variable
# (`enable_thinking`, as Qwen3's) and the generation prompt. Message contents are strings
# (vLLM's "string" content format: it joins text parts with newlines before rendering).
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content is string and loop.last %}
{{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
{%- endif %}
{%- if message.content is string %}
{{- message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{%- if not (loop.last and continue_final_message) %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# The same conversation layout for templates that walk content parts (vLLM's "openai" content
# format, detected from a loop over ``message.content``): a request may send it as its
# ``chat_template`` when the engine trusts request templates.
OPENAI_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}
{{- message.content }}
{%- else %}
{%- for part in message.content %}
{%- if part.type == 'text' %}
{{- part.text }}
{%- else %}
{{- '[' + part.type + ']' }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_SYLLABLES = (
    "ka",
    "ri",
    "to",
    "mo",
    "na",
    "shi",
    "ra",
    "te",
    "lo",
    "vi",
    "en",
    "an",
    "er",
    "in",
    "on",
    "th",
    "he",
    "re",
    "ou",
    "it",
    "is",
    "or",
    "ar",
    "al",
    "ing",
    "ion",
    "tion",
    "ed",
    "es",
    "st",
    "nd",
    "ent",
    "pro",
    "con",
    "com",
    "pre",
    "dis",
    "un",
    "ver",
    "der",
    "mer",
    "cal",
    "ment",
    "ness",
    "ous",
    "ive",
    "able",
)
_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "cache",
    "token",
    "prefix",
    "engine",
    "router",
    "request",
    "model",
    "block",
    "hash",
    "event",
    "stream",
    "replay",
)
# Text in other scripts, written out so the corpus (and so the merges) cover them.
_SCRIPTS = (
    "你好，世界。今天天气很好，我们去公园散步吧。缓存命中率很高。",  # noqa: RUF001 (on purpose)
    "東京は日本の首都です。ひらがなとカタカナも使います。",
    "안녕하세요. 오늘은 날씨가 좋네요.",
    "مرحبا بالعالم. هذه جملة باللغة العربية.",
    "שלום עולם. זה משפט בעברית.",
    "Привет, мир! Это предложение на русском языке.",
    "Γειά σου κόσμε. Αυτή είναι μια πρόταση.",  # noqa: RUF001 (on purpose)
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है।",
    "Xin chào thế giới. Đây là một câu tiếng Việt.",
    "Café naïve résumé façade jalapeño São Paulo Zürich Ångström",
    "e\u0301 a\u0308 o\u0302 n\u0303 c\u0327 (combining marks)",
    "😀 😃 🎉 👍🏽 👨‍👩‍👧‍👦 🇺🇸 🇯🇵 ❤️ 🔥 🚀",
    "∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↑ ↓ ∀ ∃ ∈ ∉ ⊂ ⊃",
)
_CODE = (
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    'import json\nprint(json.dumps({"a": 1, "b": [1, 2, 3]}))\n',
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;\n",
    "<div class=\"box\"><a href='/x?y=1&z=2'>link</a></div>\n",
)


def _line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        words[0] = words[0].capitalize()
        return " ".join(words) + rng.choice(".!?,;:")
    if kind < 0.6:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 6)))
    if kind < 0.72:
        return rng.choice(_SCRIPTS)
    if kind < 0.82:
        return rng.choice(_CODE)
    if kind < 0.9:
        record = {rng.choice(_WORDS): rng.randint(0, 10 ** rng.randint(1, 6)) for _ in range(3)}
        return json.dumps(record)
    return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(rng.randint(1, 5)))


def corpus(lines: int = _CORPUS_LINES, seed: int = _SEED) -> Iterator[str]:
    """The training text, one line at a time (the same lines for the same arguments)."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield _line(rng)


def _train(lines: Sequence[str]) -> Tokenizer:
    """A byte-level BPE over ``lines``, with an NFC normalizer and a BOS post-processor."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    # The split of GPT-4 / Llama 3 (words, numbers of up to 3 digits, punctuation runs,
    # whitespace), then bytes as printable characters.
    split = Regex(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(split, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_tokenizer(directory: str | Path) -> Path:
    """Train and save the tokenizer and chat template into ``directory`` (made if missing)."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    if (directory / "tokenizer.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # transformers' tokenizer class is untyped: built through Any.
    fast_class: Any = PreTrainedTokenizerFast
    fast = fast_class(
        tokenizer_object=_train(list(corpus())),
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


def _config(vocab_size: int) -> dict[str, Any]:
    # Tiny Llama: CPU attention wants head_dim 64 (16 is unsupported); the rest is minimal.
    return {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": True,
    }


def build_model(directory: str | Path) -> Path:
    """The tokenizer, a Llama config covering its vocabulary and seeded random weights."""
    directory = build_tokenizer(directory)
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as real vocabularies are padded
    torch.manual_seed(0)
    config = LlamaConfig(
        **_config(vocab),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvevents.testing.chat_model DIR [--tokenizer-only]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m kvevents.testing.chat_model DIR [--tokenizer-only]")
        return 2
    if "--tokenizer-only" in args:
        build_tokenizer(args[0])
    else:
        build_model(args[0])
    print(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
