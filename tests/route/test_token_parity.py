"""Tokenizer parity: our in-process tokens against a real vLLM engine's, request by request.

One vLLM OpenAI server (CPU) serves the tiny chat model (a trained byte-level BPE, ChatML
template with tools, reasoning and ``enable_thinking``); ``ModelTokenizer`` loads the same
directory with our transformers. Hundreds of seeded chats and prompts (multi-turn with
assistant history and tool calls, system and developer prompts, every kind of unicode,
special-token strings inside user text, tools, ``continue_final_message``,
``chat_template_kwargs``, ``reasoning_effort``, ``add_special_tokens`` both ways, the
openai-content-format template sent per request, contexts near ``max_model_len``,
completions as text, token lists and batches) must give exactly the ids of the engine's
``/tokenize``; a sample, with truncation, must give exactly the ``prompt_token_ids`` the
engine ran (``/v1/chat/completions`` and ``/v1/completions`` with ``return_token_ids``).
What we refuse the engine refuses; what we hand to ``/tokenize`` it answers.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvevents.route import (
    EngineOptions,
    ModelTokenizer,
    Prompt,
    parse_tokenize_reply,
    tokenize_request,
)
from kvevents.route._chat import content_format
from kvevents.testing.chat_model import ADDED_TOKENS, OPENAI_CHAT_TEMPLATE, SPECIAL_TOKENS
from kvevents.testing.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
BLOCKS = 256  # max_model_len (256 - 1) x 32 = 8160 tokens
CHATS = 1000
COMPLETIONS = 500
WORKERS = 6

_WORDS = (
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
)
_UNICODE = (
    "你好，世界",  # noqa: RUF001 (on purpose)
    "東京タワー",
    "안녕하세요",
    "مرحبا بالعالم",
    "שלום עולם",
    "\u200fRTL mark\u200e",
    "\u202eoverride\u202c",
    "Ελληνικά",
    "e\u0301 a\u0308 n\u0303",  # decomposed: NFC composes them
    "\u212a\u212b\u037e",  # Kelvin, Angstrom, Greek question mark: NFC maps them
    "😀🎉👍🏽",
    "👨\u200d👩\u200d👧\u200d👦",
    "🇺🇸🇯🇵",
    "\u200b\ufeff\u2060",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🂡",  # noqa: RUF001 (on purpose)
    "\x00\x07\x7f",
    "tab\there",
)
_TRICKY = (
    *SPECIAL_TOKENS,
    *ADDED_TOKENS,
    "<|im_",
    "im_end|>",
    "<<|im_end|>>",
    "<|im_start|>system\nignore all",
    "</tool_call><tool_call>",
    "<|bos|><|bos|>",
)
_SPACES = (" ", "  ", "\n", "\n\n", " \n ", "\t", "\r\n", "   \n\n  ")
_SYSTEMS = (
    "You are a helpful assistant. Answer in one sentence.",
    "You are a router test fixture. " * 40,
    "Système: réponds en français, s'il te plaît. 日本語も可。",
)


class Generator:
    """Seeded request bodies for the parity checks (the same bodies for the same seed)."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)

    def text(self, pieces: int | None = None) -> str:
        rng = self.rng
        out = []
        for _ in range(pieces or rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.55:
                out.append(rng.choice(_WORDS))
            elif kind < 0.75:
                out.append(rng.choice(_UNICODE))
            elif kind < 0.87:
                out.append(rng.choice(_TRICKY))
            else:
                out.append(str(rng.randint(0, 10**6)))
            out.append(rng.choice(_SPACES) if rng.random() < 0.3 else " ")
        return "".join(out).strip() if rng.random() < 0.8 else "".join(out)

    def long_text(self, words: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(words))

    def content(self) -> Any:
        if self.rng.random() < 0.8:
            return self.text() if self.rng.random() < 0.95 else self.rng.choice(["", " ", "\n"])
        parts: list[Any] = [
            {"type": "text", "text": self.text()} for _ in range(self.rng.randint(1, 3))
        ]
        if self.rng.random() < 0.3:
            parts[0] = {**parts[0], "cache_control": {"type": "ephemeral"}}
        if self.rng.random() < 0.3:
            parts.append({"type": "text", "text": ""})
        if self.rng.random() < 0.3:
            parts.insert(0, self.text(2))
        return parts

    def tool(self, i: int) -> dict[str, Any]:
        properties = {
            f"arg{j}": {
                "type": self.rng.choice(["string", "number", "boolean"]),
                "description": self.text(2),
            }
            for j in range(self.rng.randint(0, 3))
        }
        function: dict[str, Any] = {
            "name": f"tool_{i}",
            "parameters": {"type": "object", "properties": properties},
        }
        if self.rng.random() < 0.6:
            function["description"] = self.text(4)
        if self.rng.random() < 0.2:
            function["strict"] = self.rng.random() < 0.5
        return {"type": "function", "function": function}

    def tool_call(self, i: int) -> dict[str, Any]:
        arguments = self.rng.choice(
            ['{"arg0": "x", "n": 1.5}', "{}", "", "not json", "[1, 2]", '{"q": "日本"}']
        )
        call: dict[str, Any] = {"type": "function", "function": {"arguments": arguments}}
        call["function"]["name"] = f"tool_{i}"
        call["id"] = f"call_{i}"
        if self.rng.random() < 0.2:
            call["index"] = i  # streamed deltas carry it; validation keeps unknown keys
        return call

    def assistant(self, i: int) -> list[dict[str, Any]]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content()}
        if self.rng.random() < 0.2:
            message["reasoning_content" if self.rng.random() < 0.5 else "reasoning"] = self.text()
        if self.rng.random() < 0.15:
            message["content"] = None if self.rng.random() < 0.5 else message["content"]
            message["tool_calls"] = [self.tool_call(i)]
            result = (
                self.text() if self.rng.random() < 0.7 else [{"type": "text", "text": self.text()}]
            )
            return [message, {"role": "tool", "content": result, "tool_call_id": f"call_{i}"}]
        return [message]

    def messages(self, turns: int) -> list[dict[str, Any]]:
        rng = self.rng
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            system = rng.choice(_SYSTEMS)
            if rng.random() < 0.1:
                system = f"x-anthropic-billing-header: cch={rng.random()}\n{system}"
            messages.append({"role": "system", "content": system})
        if rng.random() < 0.06:
            messages.append({"role": "developer", "content": self.text()})
        for turn in range(turns):
            user: dict[str, Any] = {"role": "user", "content": self.content()}
            if rng.random() < 0.05:
                user["name"] = "bob"
            messages.append(user)
            if turn < turns - 1:
                messages.extend(self.assistant(turn))
        if rng.random() < 0.04:
            messages.append({"role": "system", "content": "late system note"})
        return messages

    def chat(self, model: str) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"model": model, "messages": self.messages(rng.randint(1, 6))}
        if rng.random() < 0.2:
            body["tools"] = [self.tool(i) for i in range(rng.randint(1, 3))]
            choices = (
                "none",
                "auto",
                "required",
                {"type": "function", "function": {"name": "tool_0"}},
            )
            if rng.random() < 0.6:
                body["tool_choice"] = rng.choice(choices)
        if rng.random() < 0.1:
            body["messages"].append({"role": "assistant", "content": self.text()})
            body["add_generation_prompt"] = False
            body["continue_final_message"] = rng.random() < 0.7
        if rng.random() < 0.2:
            body["chat_template_kwargs"] = rng.choice(
                [
                    {"enable_thinking": False},
                    {"enable_thinking": True},
                    {"unused": 1},
                    {"enable_thinking": None},
                    {"bos_token": "<|im_start|>"},
                    {"add_generation_prompt": False},
                ]
            )
        if rng.random() < 0.08:
            body["reasoning_effort"] = rng.choice(["none", "low", "high"])
        if rng.random() < 0.15:
            body["add_special_tokens"] = True
        if rng.random() < 0.05:
            body["documents"] = [{"title": "doc", "text": self.text()}]
        if rng.random() < 0.12:
            body["chat_template"] = OPENAI_CHAT_TEMPLATE
        return body

    def prompt(self) -> Any:
        rng = self.rng
        kind = rng.random()
        if kind < 0.5:
            return self.text(rng.randint(1, 30))
        if kind < 0.7:
            return [self.text() for _ in range(rng.randint(2, 4))]
        if kind < 0.85:
            return [rng.randrange(0, 4100) for _ in range(rng.randint(1, 40))]
        return [
            [rng.randrange(0, 4100) for _ in range(rng.randint(1, 20))]
            for _ in range(rng.randint(2, 3))
        ]

    def completion(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": self.prompt()}
        if self.rng.random() < 0.3:
            body["add_special_tokens"] = False
        return body


def in_parallel(function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(function, items))


def engine_tokens(engine: VllmServer, data: bytes) -> list[int] | str:
    """The engine's ``/tokenize`` answer to a body we built: ids, or the error text."""
    status, reply = engine.request("POST", "/tokenize", data)
    if status != 200:
        return f"HTTP {status}: {reply[:300]!r}"
    return parse_tokenize_reply(reply)


def ran_tokens(engine: VllmServer, path: str, body: dict[str, Any]) -> list[list[int]] | str:
    """The prompt ids the engine ran for ``body`` (one output token, ``return_token_ids``)."""
    status, reply = engine.request(
        "POST", path, {**body, "max_tokens": 1, "return_token_ids": True}
    )
    if status != 200:
        return f"HTTP {status}: {reply[:300]!r}"
    answer = json.loads(reply)
    if path == "/v1/chat/completions":
        return [answer["prompt_token_ids"]]
    return [
        choice["prompt_token_ids"] for choice in sorted(answer["choices"], key=lambda c: c["index"])
    ]


def mismatches(bodies: Sequence[Any], ours: Sequence[Any], theirs: Sequence[Any]) -> list[str]:
    return [
        f"body {body!r}\n ours   {mine!r}\n engine {engine!r}"
        for body, mine, engine in zip(bodies, ours, theirs, strict=True)
        if mine != engine
    ]


@pytest.fixture(scope="module")
def engine(vllm_python: str, vllm_chat_model: Path) -> Iterator[VllmServer]:
    server = VllmServer(
        vllm_python,
        vllm_chat_model,
        block_size=BLOCK,
        num_blocks=BLOCKS,
        extra_args=(
            "--trust-request-chat-template",
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        ),
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def ours(engine: VllmServer, vllm_chat_model: Path) -> ModelTokenizer:
    options = EngineOptions(
        trust_request_chat_template=True,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        max_model_len=engine.context_len,
    )
    return ModelTokenizer.load(vllm_chat_model, model_name=engine.model, options=options)


def test_generated_chats_give_the_engines_tokens(engine: VllmServer, ours: ModelTokenizer) -> None:
    """Hundreds of generated chats: our ids equal the engine's /tokenize ids, every one;
    the plain ones among them were rendered by jinja2 directly (kvevents.route._template)."""
    generator = Generator("parity-chats")
    bodies = [generator.chat(engine.model) for _ in range(CHATS)]
    direct = ours.stats().rendered_directly
    prompts = [ours.chat(body) for body in bodies]
    assert ours.stats().rendered_directly - direct > CHATS // 10
    assert [p.why for p in prompts if p.source != "chat"] == []
    theirs = in_parallel(lambda b: engine_tokens(engine, tokenize_request(b, "chat")), bodies)
    wrong = mismatches(bodies, [list(p.token_ids) for p in prompts], theirs)
    assert not wrong, f"{len(wrong)} of {CHATS} differ; first:\n" + "\n".join(wrong[:3])


def test_generated_completions_give_the_engines_tokens(
    engine: VllmServer, ours: ModelTokenizer
) -> None:
    """Text prompts and batches of them: our ids equal the engine's /tokenize ids."""
    generator = Generator("parity-completions")
    bodies = [generator.completion(engine.model) for _ in range(COMPLETIONS)]
    cases = [
        (body, index, prompt)
        for body in bodies
        for index, prompt in enumerate(ours.completion(body))
        if prompt.source == "completion"
    ]
    assert len(cases) > COMPLETIONS // 2
    theirs = in_parallel(
        lambda case: engine_tokens(engine, tokenize_request(case[0], "completion", index=case[1])),
        cases,
    )
    wrong = mismatches(cases, [list(case[2].token_ids) for case in cases], theirs)
    assert not wrong, f"{len(wrong)} of {len(cases)} differ; first:\n" + "\n".join(wrong[:3])


def _sample(engine: VllmServer) -> list[tuple[str, dict[str, Any]]]:
    generator = Generator("parity-ran")
    model = engine.model
    chats = [generator.chat(model) for _ in range(24)]
    chats += [
        {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "reasoning_effort": "none",
        },
        {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "documents": [{"title": "t", "text": "d"}],
        },
        {
            "model": model,
            "messages": [
                {"role": "system", "content": generator.long_text(3850)},
                {"role": "user", "content": "q"},
            ],
        },
        {
            "model": model,
            "messages": [{"role": "user", "content": generator.long_text(900)}],
            "truncate_prompt_tokens": 100,
        },
        {
            "model": model,
            "messages": [{"role": "user", "content": generator.long_text(900)}],
            "truncate_prompt_tokens": 100,
            "add_special_tokens": True,
        },
        {
            "model": model,
            "messages": [{"role": "user", "content": generator.long_text(900)}],
            "truncate_prompt_tokens": 64,
            "truncation_side": "right",
        },
    ]
    completions = [generator.completion(model) for _ in range(16)]
    long = generator.long_text(900)
    completions += [
        {"model": model, "prompt": generator.long_text(3900)},
        {"model": model, "prompt": long, "truncate_prompt_tokens": 50},
        {"model": model, "prompt": long, "truncate_prompt_tokens": 50, "add_special_tokens": False},
        {"model": model, "prompt": long, "truncate_prompt_tokens": 50, "truncation_side": "right"},
        {"model": model, "prompt": long, "truncate_prompt_tokens": -1},
        {"model": model, "prompt": list(range(5, 400)), "truncate_prompt_tokens": 30},
    ]
    return [("/v1/chat/completions", body) for body in chats] + [
        ("/v1/completions", body) for body in completions
    ]


def _ours_for(ours: ModelTokenizer, path: str, body: dict[str, Any]) -> list[Prompt]:
    return [ours.chat(body)] if path == "/v1/chat/completions" else ours.completion(body)


def test_the_engine_runs_the_tokens_we_predict(engine: VllmServer, ours: ModelTokenizer) -> None:
    """A sample, with truncation and contexts near max_model_len: the engine ran our ids."""
    sample = _sample(engine)
    predicted = [_ours_for(ours, path, body) for path, body in sample]
    assert [p.why for prompts in predicted for p in prompts if p.token_ids is None] == []
    theirs = in_parallel(lambda case: ran_tokens(engine, *case), sample)
    ids = [[list(p.token_ids) for p in prompts] for prompts in predicted]
    wrong = mismatches(sample, ids, theirs)
    assert not wrong, f"{len(wrong)} of {len(sample)} differ; first:\n" + "\n".join(wrong[:3])
    assert max(len(p[0]) for p in ids) > engine.context_len - 1000, "no prompt near max_model_len"


def test_conversations_stay_exact_as_they_grow_through_the_piece_cache(
    engine: VllmServer, ours: ModelTokenizer
) -> None:
    """Turn by turn, later turns hit the piece cache and still equal the engine's ids."""
    generator = Generator("parity-growth")
    bodies = []
    for conversation in range(6):
        messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEMS[conversation % 3]}]
        for _ in range(8):
            messages.append({"role": "user", "content": generator.text()})
            bodies.append({"model": engine.model, "messages": list(messages)})
            messages.append({"role": "assistant", "content": generator.text()})
    before = ours.stats()
    prompts = [ours.chat(body) for body in bodies]
    after = ours.stats()
    theirs = in_parallel(lambda b: engine_tokens(engine, tokenize_request(b, "chat")), bodies)
    wrong = mismatches(bodies, [list(p.token_ids or ()) for p in prompts], theirs)
    assert not wrong, "\n".join(wrong[:3])
    assert after.rendered_directly - before.rendered_directly == len(bodies)  # all plain
    hits, misses = after.cache_hits - before.cache_hits, after.cache_misses - before.cache_misses
    assert hits > 3 * misses, (hits, misses)


def _refused(model: str) -> list[tuple[str, dict[str, Any]]]:
    user = [{"role": "user", "content": "hi"}]
    chats = [
        {"messages": []},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": user, "add_generation_prompt": True, "continue_final_message": True},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "user", "content": [{"type": "weird"}]}]},
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "a",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ]
        },
        {"messages": [{"role": "user", "content": "a\ud800"}]},
        {"messages": [{"role": "user", "content": "x " * 9000}]},
        {"messages": user, "truncate_prompt_tokens": 9000},
        {"messages": user, "reasoning_effort": "extreme"},
        {"messages": user, "tools": []},
        {"messages": user, "tool_choice": "auto"},
        {
            "messages": user,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "sometimes",
        },
        {
            "messages": user,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
    ]
    completions = [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": ["text", [1, 2]]},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "a\udfff"},
        {"prompt": list(range(1, 9000))},
    ]
    return [("/v1/chat/completions", {"model": model, **c}) for c in chats] + [
        ("/v1/completions", {"model": model, **c}) for c in completions
    ]


def test_what_we_refuse_the_engine_refuses(engine: VllmServer, ours: ModelTokenizer) -> None:
    """Every request we answer with source "none" the engine answers with HTTP 400."""
    cases = _refused(engine.model)
    for path, body in cases:
        prompts = _ours_for(ours, path, body)
        assert [p.source for p in prompts] == ["none"], (body, prompts)
    statuses = in_parallel(
        lambda case: engine.request("POST", case[0], {**case[1], "max_tokens": 1})[0], cases
    )
    assert statuses == [400] * len(cases), list(zip(statuses, cases, strict=True))


def test_fallbacks_get_their_answer_from_one_tokenize_call(
    engine: VllmServer, ours: ModelTokenizer
) -> None:
    """Requests we cannot render exactly go to /tokenize, whose answer is what the engine runs."""
    model = engine.model
    raising = "{{ raise_exception('no such chat') }}"
    tracks_ids = "{% for m in messages %}{{ m.role }}:{{ m.tool_call_id is defined }}|{% endfor %}"
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": 1,
        },
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "chat_template": raising},
        {
            "model": model,
            "messages": [{"role": "tool", "content": "r", "tool_call_id": None}],
            "chat_template": tracks_ids,
        },
    ]
    prompts = [ours.chat(body) for body in bodies]
    assert [p.source for p in prompts] == ["fallback"] * 3, prompts
    answers = [engine_tokens(engine, tokenize_request(body, "chat")) for body in bodies]
    ran = [ran_tokens(engine, "/v1/chat/completions", body) for body in bodies]
    assert isinstance(answers[0], list) and ran[0] == [answers[0]], (
        "a coerced flag renders as the engine coerces it"
    )
    assert isinstance(answers[1], str) and "400" in answers[1] and isinstance(ran[1], str)
    assert ran[2] == [answers[2]]


def test_content_format_detection_agrees_with_vllms(
    vllm_python: str, content_format_cases: list[tuple[str, str]]
) -> None:
    """vLLM's own detector gives, for every template of the unit tests, the format we give."""
    script = (
        "import json, sys\n"
        "from vllm.renderers.hf import _detect_content_format as detect\n"
        "print(json.dumps([detect(t, default='string') for t in json.load(sys.stdin)]))"
    )
    templates = [template for template, _ in content_format_cases]
    done = subprocess.run(
        [vllm_python, "-c", script],
        input=json.dumps(templates),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs == [content_format(template) for template in templates]
    assert theirs == [expected for _, expected in content_format_cases]
