"""A chat body becomes the template inputs vLLM 0.32 builds from it (facts read from vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from kvevents.route._chat import (
    ChatOptions,
    NoTokens,
    check_tool_choice,
    content_format,
    conversation,
    developer_as_system,
    template_kwargs,
    tool_dicts,
    version_sensitive,
)
from kvevents.testing.chat_model import CHAT_TEMPLATE


def _parts(*texts: Any) -> list[Any]:
    return [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]


def test_string_format_joins_text_parts_with_newlines_and_skips_empty_ones() -> None:
    """Text parts join with "\\n"; empty and value-less text parts vanish; raw strings count."""
    parts = [
        *_parts("a", ""),
        {"type": "text", "text": None},
        "raw",
        {"type": "refusal", "refusal": "r"},
    ]
    (message,) = conversation([{"role": "user", "content": parts}], "string")
    assert message == {"role": "user", "content": "a\nraw\nr"}


def test_openai_format_keeps_text_dicts_with_their_unknown_fields() -> None:
    """In the openai format text parts stay dicts, known fields dropped, others (cache_control) kept."""
    parts = [
        {"z": 1, "type": "text", "uuid": None, "text": "x", "cache_control": {"type": "ephemeral"}},
        "raw",
    ]
    (message,) = conversation([{"role": "user", "content": parts}], "openai")
    assert message["content"] == [
        {"type": "text", "text": "x", "z": 1, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "raw"},
    ]
    assert list(message["content"][0]) == ["type", "text", "z", "cache_control"]


def test_text_part_kinds_and_tool_references() -> None:
    """input_text, output_text and thinking are text; a tool reference gives its name."""
    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "output_text", "text": "b"},
        {"type": "thinking", "thinking": "c", "closed": True},
        {"type": "tool_reference", "name": "t"},
    ]
    (flat,) = conversation([{"role": "user", "content": parts}], "string")
    assert flat["content"] == "a\nb\nc\nt"
    (rich,) = conversation([{"role": "user", "content": parts}], "openai")
    assert rich["content"][-1] == {"type": "tool_reference", "name": "t"}
    assert rich["content"][2] == {"type": "text", "text": "c"}


def test_a_system_billing_header_line_is_dropped() -> None:
    """Claude Code's per-request attribution line leaves system prompts (vLLM drops it too)."""
    content = "x-anthropic-billing-header: cch=42\nreal prompt"
    (message,) = conversation([{"role": "system", "content": content}], "string")
    assert message["content"] == "real prompt"
    (only,) = conversation(
        [{"role": "system", "content": "x-anthropic-billing-header: 1"}], "string"
    )
    assert only["content"] == ""


def test_assistant_tool_calls_are_ordered_and_their_arguments_decoded() -> None:
    """Tool calls keep the validated key order; arguments decode to an object or become {}."""
    calls = [
        {
            "type": "function",
            "extra": 2,
            "function": {"zz": 1, "name": "f", "arguments": '{"b": 1, "a": 2}'},
            "id": "1",
        },
        *(
            {"id": str(i), "type": "function", "function": {"name": "g", "arguments": args}}
            for i, args in enumerate(["[1]", "not json", "", "null"])
        ),
    ]
    (message,) = conversation(
        [{"role": "assistant", "content": None, "tool_calls": calls}], "string"
    )
    first = message["tool_calls"][0]
    assert list(first) == ["id", "function", "type", "extra"]
    assert list(first["function"]) == ["arguments", "name", "zz"]
    assert first["function"]["arguments"] == {"b": 1, "a": 2}
    assert [call["function"]["arguments"] for call in message["tool_calls"][1:]] == [{}] * 4
    assert message["content"] == ""


def test_empty_tool_calls_are_dropped_and_reasoning_is_copied() -> None:
    """``tool_calls: []`` disappears; reasoning (or reasoning_content) lands under both names."""
    (message,) = conversation(
        [{"role": "assistant", "content": "a", "tool_calls": [], "reasoning_content": "r"}],
        "string",
    )
    assert message == {
        "role": "assistant",
        "content": "a",
        "reasoning": "r",
        "reasoning_content": "r",
    }


def test_tool_and_developer_messages() -> None:
    """A tool message keeps its call id (openai format joins its texts); a developer its tools."""
    tool = {"role": "tool", "content": _parts("a", "b"), "tool_call_id": "c"}
    (message,) = conversation([tool], "openai")
    assert message == {"role": "tool", "content": "a\nb", "tool_call_id": "c"}
    (developer,) = conversation([{"role": "developer", "content": "d", "name": "n"}], "string")
    assert developer == {"role": "developer", "content": "d", "name": "n", "tools": None}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": None},
        {"role": "user", "content": 5},
        {"role": "user", "content": "x", "name": 5},
        {"content": "no role"},
        {"role": "user", "content": [{"type": "text", "text": 5}]},
        {"role": "user", "content": [{"type": "weird"}]},
        {"role": "user", "content": [{"text": "no type"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "custom", "custom": {}}],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
    ],
)
def test_messages_the_engine_refuses_are_refused(message: dict[str, Any]) -> None:
    """Shapes vLLM answers with HTTP 400 raise NoTokens(refused=True)."""
    with pytest.raises(NoTokens) as caught:
        conversation([message], "string")
    assert caught.value.refused


def test_media_parts_go_to_the_engine_marked_multimodal() -> None:
    """An image (typed or not) is not rebuilt here: NoTokens, multimodal, not refused."""
    for part in (
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"image_url": "http://x"},
    ):
        with pytest.raises(NoTokens) as caught:
            conversation([{"role": "user", "content": [part]}], "string")
        assert caught.value.multimodal and not caught.value.refused
        assert "image_url part" in caught.value.why


def test_developer_messages_become_one_system_message_for_templates_without_them() -> None:
    """Developer -> system (tools dropped), then all system messages merged first."""
    messages = [
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d", "tools": None},
        {"role": "system", "content": "s"},
    ]
    assert developer_as_system(messages, CHAT_TEMPLATE) == [
        {"role": "system", "content": "d\n\ns"},
        {"role": "user", "content": "u"},
    ]
    aware = "{% if m.role == 'developer' %}{% endif %}"
    assert developer_as_system(messages, aware) is messages
    no_developer = [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]
    assert developer_as_system(no_developer, CHAT_TEMPLATE) is no_developer


def test_tools_dump_as_the_validated_model_does() -> None:
    """Missing fields become None, strict/defer_loading only when given, unknown keys dropped."""
    body = {
        "tools": [
            {"function": {"name": "f", "x": 1}, "y": 2},
            {
                "type": "function",
                "defer_loading": True,
                "function": {"name": "g", "parameters": {"p": 1.0}, "strict": False},
            },
        ]
    }
    assert tool_dicts(body) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": {"p": 1.0},
                "strict": False,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert tool_dicts({**body, "tool_choice": "none"}, exclude_when_none=True) is None
    assert tool_dicts(body, exclude_when_none=True) is not None  # tools without a choice: "auto"


def test_template_kwargs_layering() -> None:
    """Request flags over chat_template_kwargs over engine defaults; None dropped; tools kwarg wins."""
    body = {
        "add_generation_prompt": False,
        "reasoning_effort": "none",
        "documents": [{"title": "t"}],
        "chat_template_kwargs": {
            "add_generation_prompt": True,
            "gone": None,
            "tools": ["mine"],
            "padding": 1,
        },
    }
    kwargs = template_kwargs(
        ChatOptions.read(body), [{"t": 1}], {"enable_thinking": True, "extra": 2}
    )
    assert kwargs == {
        "enable_thinking": False,
        "extra": 2,
        "tools": ["mine"],
        "add_generation_prompt": False,
        "continue_final_message": False,
        "documents": [{"title": "t"}],
        "reasoning_effort": "none",
    }
    kept = template_kwargs(
        ChatOptions.read(
            {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
        ),
        None,
        {},
    )
    assert kept["enable_thinking"] is False


@pytest.mark.parametrize("name", ["tokenize", "conversation", "chat_template"])
def test_kwargs_that_change_the_call_itself_go_to_the_engine(name: str) -> None:
    """``tokenize``, ``conversation``, ``chat_template`` in kwargs: not rebuilt here."""
    with pytest.raises(NoTokens) as caught:
        template_kwargs(ChatOptions.read({"chat_template_kwargs": {name: True}}), None, {})
    assert name in caught.value.why and not caught.value.refused


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, True),
        ({"add_generation_prompt": "yes"}, False),
        ({"chat_template_kwargs": []}, True),
        ({"reasoning_effort": "extreme"}, True),
    ],
)
def test_option_values_the_engine_refuses_or_coerces(body: dict[str, Any], refused: bool) -> None:
    """Refused when vLLM answers 400; handed to the engine when pydantic would coerce."""
    with pytest.raises(NoTokens) as caught:
        ChatOptions.read(body)
    assert caught.value.refused is refused


@pytest.mark.parametrize(
    ("body", "allowed"),
    [
        ({}, True),
        ({"tools": [{"function": {"name": "f"}}], "tool_choice": "none"}, True),
        ({"tools": [{"function": {"name": "f"}}]}, False),  # "auto" by default
        ({"tools": []}, False),
        ({"tool_choice": "auto"}, False),
        (
            {"tools": [{"function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
            False,
        ),
    ],
)
def test_tool_choices_the_default_engine_refuses(body: dict[str, Any], allowed: bool) -> None:
    """Without --enable-auto-tool-choice, tools without a choice (auto) are refused."""
    if allowed:
        check_tool_choice(body, auto_tool_choice=False, tool_parser=False)
    else:
        with pytest.raises(NoTokens):
            check_tool_choice(body, auto_tool_choice=False, tool_parser=False)


def test_tool_choices_with_a_tool_parser() -> None:
    """With a parser, auto, required and a named tool pass; a name of no tool does not."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        check_tool_choice(
            {"tools": tools, "tool_choice": choice}, auto_tool_choice=True, tool_parser=True
        )
    with pytest.raises(NoTokens):
        check_tool_choice(
            {"tools": tools, "tool_choice": {"function": {"name": "g"}}},
            auto_tool_choice=True,
            tool_parser=True,
        )


def test_content_format_detection(content_format_cases: list[tuple[str, str]]) -> None:
    """Loops over message content (aliases, filters, slices, macros) mean openai; else string."""
    for template, expected in content_format_cases:
        assert content_format(template) == expected, template


def test_null_keys_and_reasoning_are_flagged_only_where_the_template_sees_them() -> None:
    """Version-sensitive inputs fall back only when the template names them or walks items()."""
    tool = [{"role": "tool", "content": "r", "tool_call_id": None}]
    assert version_sensitive(tool, "{{ m.content }}") is None
    assert "tool_call_id" in (version_sensitive(tool, "{{ m.tool_call_id }}") or "")
    assert version_sensitive(tool, "{% for k, v in m.items() %}{% endfor %}") is not None
    reasoning = [{"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}]
    assert version_sensitive(reasoning, CHAT_TEMPLATE) is None  # enable_thinking is not thinking
    assert version_sensitive(reasoning, "{{ m.thinking }}") is not None
