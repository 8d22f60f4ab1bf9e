"""Fixtures of the front door's tests: stand-in engines and proxies in front of them, and
the tiny chat model, built once per session.

``chat_model_tokenizer`` is the tokenizer and chat template alone (built here, in seconds);
``vllm_chat_model`` adds the weights, built by vLLM's interpreter (it has torch). The vLLM
tests skip without vLLM, or fail when ``KVEVENTS_REQUIRE_VLLM`` is set (CI sets it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvevents.testing.chat_model import CHAT_TEMPLATE, OPENAI_CHAT_TEMPLATE, build_tokenizer
from kvevents.testing.openai_engine import StandInEngine
from kvevents.testing.route import RunningProxy, running_proxy
from kvevents.testing.vllm_server import build_chat_model, find_vllm_python, vllm_unavailable


@pytest.fixture
def engines() -> Iterator[Callable[..., StandInEngine]]:
    """A factory of started stand-in engines, all closed after the test."""
    made: list[StandInEngine] = []

    def make(*models: str, **options: Any) -> StandInEngine:
        engine = StandInEngine(models or ("stand-in",), **options)
        made.append(engine)
        return engine.start()

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def proxy() -> Iterator[Callable[..., RunningProxy]]:
    """A factory of started front doors (``running_proxy`` arguments), stopped after the test."""
    with contextlib.ExitStack() as stack:

        def make(*engines: StandInEngine | str, **options: Any) -> RunningProxy:
            urls = [e if isinstance(e, str) else e.url for e in engines]
            return stack.enter_context(running_proxy(urls, **options))

        yield make


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
