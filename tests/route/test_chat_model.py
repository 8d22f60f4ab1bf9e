"""The tiny chat model fixture: deterministic, covers any text, renders like a real template."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.testing import chat_model


@pytest.fixture(scope="module")
def hf(chat_model_tokenizer: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model_tokenizer))


def test_two_builds_are_byte_identical(chat_model_tokenizer: Path, tmp_path: Path) -> None:
    """The corpus, training and saved files are the same on every build."""
    again = chat_model.build_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (chat_model_tokenizer / name).read_bytes(), name


def test_building_into_a_built_directory_changes_nothing(chat_model_tokenizer: Path) -> None:
    """A second build returns at once and leaves the files alone."""
    before = (chat_model_tokenizer / "tokenizer.json").stat().st_mtime_ns
    assert chat_model.build_tokenizer(chat_model_tokenizer) == chat_model_tokenizer
    assert (chat_model_tokenizer / "tokenizer.json").stat().st_mtime_ns == before


def test_the_vocabulary_has_every_special_and_added_token_whole(hf: object) -> None:
    """Special and added tokens are one id each, after the trained vocabulary."""
    assert len(hf) == chat_model.VOCAB_SIZE + len(chat_model.ADDED_TOKENS)  # type: ignore[arg-type]
    for token in (*chat_model.SPECIAL_TOKENS, *chat_model.ADDED_TOKENS):
        assert len(hf(token, add_special_tokens=False)["input_ids"]) == 1, token  # type: ignore[operator]
    assert hf("x")["input_ids"][0] == hf.bos_token_id  # type: ignore[operator, attr-defined]


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_encodes_and_decodes_back(hf: object, text: str) -> None:
    """Byte-level: every unicode text has tokens and decodes to its NFC form."""
    ids = hf(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert hf.decode(ids) == unicodedata.normalize("NFC", text)  # type: ignore[attr-defined]


def test_the_template_renders_systems_tools_reasoning_and_the_generation_prompt(hf: object) -> None:
    """A BOS, the tools block with tojson, reasoning on the last turn, enable_thinking."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {
            "role": "assistant",
            "content": "A",
            "reasoning_content": " R ",
            "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
        },
    ]
    text = hf.apply_chat_template(  # type: ignore[attr-defined]
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == (
        "<|bos|><|im_start|>system\nS\n\n# Tools\n\nYou may call these functions:\n<tools>\n"
        '{"type": "function", "function": {"name": "f"}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nU<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nR\n</think>\n\nA\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
        "</tool_call><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_main_without_a_directory_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m kvevents.testing.chat_model`` with no argument: usage, exit status 2."""
    assert chat_model.main([]) == 2
    assert "usage" in capsys.readouterr().out
