"""ModelTokenizer without an engine: loading, what is exact, what falls back, the /tokenize body."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvevents.errors import KVEventsError
from kvevents.route import (
    EngineOptions,
    ModelTokenizer,
    Prompt,
    TokenizerNotFound,
    parse_tokenize_reply,
    tokenize_request,
)

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer(chat_model_tokenizer: Path) -> ModelTokenizer:
    return ModelTokenizer.load(chat_model_tokenizer, model_name="tiny")


def _expected_chat(mt: ModelTokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    text = mt.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return list(mt.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_missing_directory_names_the_source(tmp_path: Path) -> None:
    """A path that is not there: TokenizerNotFound (a LookupError) naming it."""
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerNotFound) as caught:
        ModelTokenizer.load(missing, model_name="m")
    assert str(missing) in str(caught.value) and "no such directory" in str(caught.value)
    assert isinstance(caught.value, LookupError) and isinstance(caught.value, KVEventsError)
    assert caught.value.source == str(missing)


def test_a_directory_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    """An existing directory with no tokenizer files is named, with what went wrong."""
    with pytest.raises(TokenizerNotFound, match="no loadable tokenizer"):
        ModelTokenizer.load(tmp_path, model_name="m")


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env, "PYTHONPATH": src},
    )


def _fake_cache(cache: Path, repo: str, files: Path) -> None:
    """A Hugging Face hub cache holding ``files`` as the one snapshot of ``repo``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / ("0" * 40)
    shutil.copytree(files, snapshot)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')  # every model repo has one
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)


def test_a_model_id_loads_from_the_local_cache_and_nothing_is_downloaded(
    chat_model_tokenizer: Path, tmp_path: Path
) -> None:
    """A model id in the local cache loads; one not in it fails naming it, offline or not."""
    _fake_cache(tmp_path, "kvevents/tiny-chat", chat_model_tokenizer)
    code = (
        "from kvevents.route import ModelTokenizer, TokenizerNotFound\n"
        "mt = ModelTokenizer.load('kvevents/tiny-chat', model_name='m')\n"
        "print(len(mt.chat({'messages': [{'role': 'user', 'content': 'hi'}]}).token_ids))\n"
        "try:\n"
        "    ModelTokenizer.load('kvevents/not-cached', model_name='m')\n"
        "except TokenizerNotFound as exc:\n"
        "    print(exc)\n"
    )
    # An unreachable proxy: any download attempt would fail differently (and slowly).
    env = {
        "HF_HUB_CACHE": str(tmp_path),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HF_HUB_OFFLINE": "0",
    }
    done = _run(code, env)
    assert done.returncode == 0, done.stderr
    count, message = done.stdout.strip().splitlines()[-2:]
    assert int(count) > 5
    assert "'kvevents/not-cached'" in message and "local Hugging Face cache" in message


def test_loading_prints_no_pytorch_advice(chat_model_tokenizer: Path) -> None:
    """transformers' "PyTorch was not found" warning is not printed by the router's import."""
    code = f"from kvevents.route import ModelTokenizer\nModelTokenizer.load({str(chat_model_tokenizer)!r}, model_name='m')\n"
    done = _run(code, {})
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr
    if importlib.util.find_spec("torch") is None:  # with torch there is no advice to drop
        control = _run("import transformers", {})
        assert "PyTorch was not found" in control.stderr, "the advice is gone upstream"


def test_a_chat_is_the_template_render_encoded_without_special_tokens(
    tokenizer: ModelTokenizer,
) -> None:
    """A plain chat: source "chat", ids of apply_chat_template's text (BOS from the template)."""
    messages = [{"role": "system", "content": "sys"}, *USER]
    prompt = tokenizer.chat({"messages": messages})
    assert prompt == Prompt(_expected_chat(tokenizer, messages), "chat")
    assert prompt.token_ids[0] == tokenizer.tokenizer.bos_token_id
    doubled = tokenizer.chat({"messages": messages, "add_special_tokens": True})
    assert doubled.token_ids == [tokenizer.tokenizer.bos_token_id, *prompt.token_ids]


def test_chat_options_reach_the_template(tokenizer: ModelTokenizer) -> None:
    """enable_thinking and reasoning_effort switch the empty think block; tools are rendered."""
    plain = tokenizer.chat({"messages": USER}).token_ids
    off = tokenizer.chat(
        {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    ).token_ids
    effort = tokenizer.chat({"messages": USER, "reasoning_effort": "none"}).token_ids
    assert off == effort == _expected_chat(tokenizer, USER, enable_thinking=False) != plain
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    options = EngineOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with_tools = ModelTokenizer(tokenizer.tokenizer, model_name="m", options=options)
    rendered = with_tools.chat({"messages": USER, "tools": tools}).token_ids
    dumped = [
        {
            "type": "function",
            "function": {"name": "lookup", "description": None, "parameters": None},
        }
    ]
    assert rendered == _expected_chat(tokenizer, USER, tools=dumped)


def test_tools_on_a_default_engine_are_refused_unless_tool_choice_is_none(
    tokenizer: ModelTokenizer,
) -> None:
    """Tools without a choice mean "auto", which a default vLLM refuses; "none" renders them."""
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    assert tokenizer.chat({"messages": USER, "tools": tools}).source == "none"
    assert (
        tokenizer.chat({"messages": USER, "tools": tools, "tool_choice": "none"}).source == "chat"
    )


def test_kv_transfer_ids_are_run_as_given(tokenizer: ModelTokenizer) -> None:
    """Disaggregated decode: forwarded prompt ids are the prompt; bad ones are refused."""
    body = {"messages": USER, "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}
    assert tokenizer.chat(body) == Prompt([5, 6, 7], "tokens")
    assert tokenizer.chat({**body, "echo": True}).source == "chat"
    bad = {"messages": USER, "kv_transfer_params": {"prompt_token_ids": [5, -1]}}
    assert tokenizer.chat(bad).source == "none"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "image_url part",
        ),
        ({"messages": USER, "add_generation_prompt": "yes"}, "not a boolean"),
        ({"messages": USER, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
        (
            {"messages": USER, "chat_template_kwargs": {"sanitize_control_tokens": True}},
            "sanitize_control_tokens",
        ),
    ],
)
def test_what_only_the_engine_can_say_falls_back(
    tokenizer: ModelTokenizer, body: dict[str, Any], why: str
) -> None:
    """Media, coerced flags, kwargs that change the template call: source "fallback"."""
    prompt = tokenizer.chat(body)
    assert prompt.source == "fallback" and prompt.token_ids is None
    assert why in (prompt.why or "")
    assert prompt.multimodal is ("image_url" in why)


def test_a_template_that_fails_here_falls_back_with_its_error(chat_model_tokenizer: Path) -> None:
    """A request template that raises: fallback with the template's reason (when trusted)."""
    trusting = ModelTokenizer.load(
        chat_model_tokenizer,
        model_name="m",
        options=EngineOptions(trust_request_chat_template=True),
    )
    body = {"messages": USER, "chat_template": "{{ raise_exception('unsupported role') }}"}
    prompt = trusting.chat(body)
    assert prompt.source == "fallback" and "unsupported role" in (prompt.why or "")
    untrusting = ModelTokenizer.load(chat_model_tokenizer, model_name="m")
    assert untrusting.chat(body).source == "none"


def test_null_fields_a_template_reads_fall_back(chat_model_tokenizer: Path) -> None:
    """A null message field the template names: transformers versions differ, so fallback."""
    trusting = ModelTokenizer.load(
        chat_model_tokenizer,
        model_name="m",
        options=EngineOptions(trust_request_chat_template=True),
    )
    template = "{% for m in messages %}{{ m.tool_call_id is defined }}{% endfor %}"
    body = {
        "messages": [{"role": "tool", "content": "r", "tool_call_id": None}],
        "chat_template": template,
    }
    assert trusting.chat(body).source == "fallback"
    plain = {"messages": [{"role": "tool", "content": "r", "tool_call_id": None}]}
    assert trusting.chat(plain).source == "chat"


@pytest.mark.parametrize(
    ("marker", "why"),
    [("config.json", "Harmony"), ("tekken.json", "mistral_common")],
)
def test_models_vllm_does_not_render_with_the_template_fall_back(
    chat_model_tokenizer: Path, tmp_path: Path, marker: str, why: str
) -> None:
    """gpt-oss (Harmony) and Mistral (mistral_common) chats go to the engine."""
    directory = tmp_path / "model"
    shutil.copytree(chat_model_tokenizer, directory)
    (directory / marker).write_text(json.dumps({"model_type": "gpt_oss"}))
    prompt = ModelTokenizer.load(directory, model_name="m").chat({"messages": USER})
    assert prompt.source == "fallback" and why in (prompt.why or "")


def test_completions_text_tokens_and_batches(tokenizer: ModelTokenizer) -> None:
    """Text gets the BOS unless add_special_tokens is false; token lists pass as given."""
    hf = tokenizer.tokenizer
    text = "one <|im_end|> two"
    assert tokenizer.completion({"prompt": text}) == [Prompt(hf(text)["input_ids"], "completion")]
    bare = tokenizer.completion({"prompt": [text, "x"], "add_special_tokens": False})
    assert [p.token_ids for p in bare] == [
        hf(t, add_special_tokens=False)["input_ids"] for t in (text, "x")
    ]
    assert tokenizer.completion({"prompt": [[1, 2], [3]]}) == [
        Prompt([1, 2], "tokens"),
        Prompt([3], "tokens"),
    ]
    assert tokenizer.completion({"prompt": [4, 5]}) == [Prompt([4, 5], "tokens")]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": ["a", [1]]},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "prompt_embeds": "abc"},
        {"prompt": [1, -2]},
        {},
    ],
)
def test_completions_the_engine_refuses_are_none(
    tokenizer: ModelTokenizer, body: dict[str, Any]
) -> None:
    """Empty prompts, mixed batches, suffix, embeddings: one record, source "none"."""
    (prompt,) = tokenizer.completion(body)
    assert prompt.source == "none" and prompt.why


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("keep", [1, 2, 5, 40])
def test_truncation_is_the_tokenizers_own_left_truncation(
    tokenizer: ModelTokenizer, special: bool, keep: int
) -> None:
    """truncate_prompt_tokens without a side: what the tokenizer's truncation (left) gives."""
    text = "one two three four five six seven eight nine ten eleven twelve"
    body = {"prompt": text, "truncate_prompt_tokens": keep, "add_special_tokens": special}
    expected = tokenizer.tokenizer(
        text, truncation=True, max_length=keep, add_special_tokens=special
    )["input_ids"]
    (prompt,) = tokenizer.completion(body)
    assert prompt.token_ids == expected


def test_truncation_with_a_side_slices_the_ids(tokenizer: ModelTokenizer) -> None:
    """With truncation_side the ids are sliced whole, BOS included; token lists likewise."""
    text = "one two three four five six seven eight"
    full = tokenizer.tokenizer(text)["input_ids"]
    left = tokenizer.completion(
        {"prompt": text, "truncate_prompt_tokens": 3, "truncation_side": "left"}
    )
    right = tokenizer.completion(
        {"prompt": text, "truncate_prompt_tokens": 3, "truncation_side": "right"}
    )
    assert left[0].token_ids == full[-3:] and right[0].token_ids == full[:3]
    (ids,) = tokenizer.completion({"prompt": list(range(10, 30)), "truncate_prompt_tokens": 4})
    assert ids.token_ids == list(range(26, 30))


def test_truncation_to_the_model_length(chat_model_tokenizer: Path) -> None:
    """-1 keeps max_model_len (minus one when output is asked); without it: none."""
    ids = list(range(10, 110))
    limited = ModelTokenizer.load(
        chat_model_tokenizer, model_name="m", options=EngineOptions(max_model_len=50)
    )
    (prompt,) = limited.completion({"prompt": ids, "truncate_prompt_tokens": -1})
    assert prompt.token_ids == ids[-49:]  # max_tokens defaults to 16 for completions
    (silent,) = limited.completion({"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 0})
    assert silent.token_ids == ids[-50:]
    (too_long,) = limited.completion({"prompt": ids})
    assert too_long.source == "none" and "max_model_len" in (too_long.why or "")
    unlimited = ModelTokenizer.load(chat_model_tokenizer, model_name="m")
    assert unlimited.completion({"prompt": ids, "truncate_prompt_tokens": -1})[0].source == "none"


def test_lone_surrogates_are_refused_like_the_engine_refuses_them(
    tokenizer: ModelTokenizer,
) -> None:
    """Text JSON can carry but UTF-8 cannot: source "none", never an exception."""
    assert tokenizer.completion({"prompt": "a\ud800"})[0].source == "none"
    assert tokenizer.chat({"messages": [{"role": "user", "content": "b\udfff"}]}).source == "none"


def test_stats_count_prompts_by_source(chat_model_tokenizer: Path) -> None:
    """Every answer is counted under its source; the piece cache's lookups are counted."""
    mt = ModelTokenizer.load(chat_model_tokenizer, model_name="m")
    mt.chat({"messages": USER})
    mt.chat({"messages": USER})
    mt.completion({"prompt": ["a", [1]]})
    mt.completion({"prompt": [[1], [2]]})
    mt.chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        }
    )
    stats = mt.stats()
    assert (stats.chat, stats.completion, stats.tokens, stats.fallback, stats.none) == (
        2,
        0,
        2,
        1,
        1,
    )
    assert stats.cache_hits > 0 and stats.cache_misses > 0 and stats.uncached is None


def test_the_tokenize_body_carries_what_the_chat_endpoint_renders() -> None:
    """documents, reasoning_effort (and enable_thinking) move into chat_template_kwargs."""
    body = {
        "model": "m",
        "messages": USER,
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"x": 1},
        "tools": [{"function": {"name": "f"}}],
        "tool_choice": "none",
        "max_tokens": 3,
        "stream": True,
    }
    request = json.loads(tokenize_request(body, "chat"))
    assert request == {
        "model": "m",
        "messages": USER,
        "chat_template_kwargs": {
            "x": 1,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "documents": [{"title": "t", "text": "d"}],
            "reasoning_effort": "none",
            "enable_thinking": False,
        },
        "tools": [{"function": {"name": "f"}}],
    }
    excluded = json.loads(tokenize_request(body, "chat", exclude_tools_when_tool_choice_none=True))
    assert "tools" not in excluded


def test_the_tokenize_body_of_a_completion_takes_one_text() -> None:
    """One text per call (the batch's index-th); token prompts need no call."""
    body = {"model": "m", "prompt": ["a", "b"], "add_special_tokens": False}
    assert json.loads(tokenize_request(body, "completion", index=1)) == {
        "model": "m",
        "prompt": "b",
        "add_special_tokens": False,
    }
    with pytest.raises(ValueError, match="token ids need no /tokenize"):
        tokenize_request({"prompt": [1, 2]}, "completion")


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"nope", "not JSON"),
        (b"[1]", "not an object"),
        (b'{"error": {"message": "bad"}}', "answered an error"),
        (b'{"tokens": [1, "x"]}', "no list of token ids"),
        (b'{"tokens": [1, 2], "count": 3}', "counts 3"),
    ],
)
def test_tokenize_replies_that_are_not_ids_say_why(data: bytes, error: str) -> None:
    """A reply that is not a list of ids raises ValueError saying what is wrong."""
    with pytest.raises(ValueError, match=error):
        parse_tokenize_reply(data)


def test_a_tokenize_reply_gives_its_ids() -> None:
    """The engine's answer shape: count, max_model_len, tokens."""
    assert parse_tokenize_reply(b'{"count": 2, "max_model_len": 8, "tokens": [4, 5]}') == [4, 5]


def test_the_engines_content_format_flag_overrides_detection(chat_model_tokenizer: Path) -> None:
    """--chat-template-content-format string: parts are joined even for a parts template."""
    from kvevents.testing.chat_model import OPENAI_CHAT_TEMPLATE

    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        "chat_template": OPENAI_CHAT_TEMPLATE,
    }
    detected, forced = (
        ModelTokenizer.load(
            chat_model_tokenizer,
            model_name="m",
            options=EngineOptions(
                trust_request_chat_template=True, chat_template_content_format=fmt
            ),
        ).chat(body)
        for fmt in ("auto", "string")
    )
    hf = ModelTokenizer.load(chat_model_tokenizer, model_name="m").tokenizer
    joined = "<|bos|><|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    assert forced.token_ids == hf(joined, add_special_tokens=False)["input_ids"]
    assert (
        detected.token_ids
        == hf(joined.replace("a\nb", "ab"), add_special_tokens=False)["input_ids"]
    )
