"""Fixtures of the front door's tests: the tiny chat model, built once per session.

``chat_model_tokenizer`` is the tokenizer and chat template alone (built here, in seconds);
``vllm_chat_model`` adds the weights, built by vLLM's interpreter (it has torch). The vLLM
tests skip without vLLM, or fail when ``KVEVENTS_REQUIRE_VLLM`` is set (CI sets it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvevents.testing.chat_model import CHAT_TEMPLATE, OPENAI_CHAT_TEMPLATE, build_tokenizer
from kvevents.testing.vllm_server import build_chat_model, find_vllm_python, vllm_unavailable


@pytest.fixture(scope="session")
def chat_model_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny chat model's tokenizer and chat template (no weights)."""
    return build_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's interpreter; skip without it, or fail when KVEVENTS_REQUIRE_VLLM is set."""
    reason = vllm_unavailable()
    if reason is not None and os.environ.get("KVEVENTS_REQUIRE_VLLM"):
        pytest.fail(f"KVEVENTS_REQUIRE_VLLM is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    python = find_vllm_python()
    assert python is not None
    return python


@pytest.fixture(scope="session")
def vllm_chat_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with its weights, ready for vLLM's OpenAI server."""
    return build_chat_model(vllm_python, tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="session")
def content_format_cases() -> list[tuple[str, str]]:
    """Templates and the content format vLLM detects for each (the parity suite asks vLLM)."""
    return [
        (CHAT_TEMPLATE, "string"),
        (OPENAI_CHAT_TEMPLATE, "openai"),
        (
            "{% for m in messages %}{% for p in m['content'] | selectattr('type') %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),
        ("{% for content in contents %}{% endfor %}", "string"),
        ("{% set content = x %}{% for item in content %}{% endfor %}", "openai"),
        ("{% for k, v in messages %}{% for p in k.content %}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% generation %}{% for p in m.content %}{% endfor %}{% endgeneration %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %", "string"),
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(c=m.content) }}{% endfor %}",
            "openai",
        ),
        ("{% macro f() %}{% for x in content %}{% endfor %}{% endmacro %}{{ f() }}", "string"),
        (
            "{% set a = messages %}{% set b = a %}{% for m in b %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
    ]
