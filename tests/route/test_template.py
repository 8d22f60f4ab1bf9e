"""Plain chats rendered by jinja2 directly give exactly the tokenizer's own rendering; a
template or a chat that could differ stays on the tokenizer's call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.route import ModelTokenizer
from kvevents.route._template import DirectTemplates, plain
from kvevents.testing.chat_model import CHAT_TEMPLATE, OPENAI_CHAT_TEMPLATE, SPECIAL_TOKENS

# Templates of the shapes models ship: role headers with special tokens, a BOS variable, a
# system prompt pulled out first, namespaces, loop controls, tojson, a date, role checks.
TEMPLATES = {
    "tiny chat model": CHAT_TEMPLATE,
    "openai content": OPENAI_CHAT_TEMPLATE,
    "headers with bos": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "system first, namespace, loop controls": (
        "{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% set ns.system = m.content %}{% continue %}{% endif %}{% endfor %}"
        "{% if ns.system %}[SYS]{{ ns.system }}[/SYS]\n{% endif %}"
        "{% for m in messages if m.role != 'system' %}"
        "  {{ m.role | upper }}{% if m.name is defined %} ({{ m.name }}){% endif %}: "
        "{{ m.content | tojson }}\n"
        "{% if loop.index > 40 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
    "alternating roles or raise, a date": (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ eos_token if m.role == 'assistant' else '' }}{{ m.content }}\n{% endfor %}"
        "{{ strftime_now('%Y') }}"
    ),
}

_piece = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8),
    st.sampled_from([*SPECIAL_TOKENS, "{{", "}}", "{%", "%}", "\n", " ", "\t"]),
)
_text = st.lists(_piece, max_size=6).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text},
    optional={"name": st.sampled_from(["ann", "bot"])},
)
_chat = st.lists(_message, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def tokenizer(chat_model_tokenizer: Path) -> ModelTokenizer:
    return ModelTokenizer.load(chat_model_tokenizer, model_name="tiny")


def _theirs(mt: ModelTokenizer, template: str, chat: list[Any], generation: bool) -> str | None:
    try:
        text = mt.tokenizer.apply_chat_template(
            [dict(m) for m in chat],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=generation,
        )
    except Exception:  # the template refuses the chat: the direct path must not answer it
        return None
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=_chat, generation=st.booleans())
def test_a_plain_chat_renders_as_the_tokenizer_renders_it(
    tokenizer: ModelTokenizer, name: str, chat: list[Any], generation: bool
) -> None:
    template = TEMPLATES[name]
    direct = DirectTemplates(
        tokenizer.tokenizer.apply_chat_template, tokenizer.tokenizer.special_tokens_map
    )
    kwargs = {"add_generation_prompt": generation, "continue_final_message": False, "tools": None}
    ours = direct.render(template, chat, kwargs)
    assert direct.refused(template) is None  # proven on the probes
    assert ours == _theirs(tokenizer, template, chat, generation)


def test_the_model_tokenizer_renders_plain_chats_directly_and_counts_them(
    tokenizer: ModelTokenizer,
) -> None:
    before = tokenizer.stats().rendered_directly
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    prompt = tokenizer.chat(body)
    expected = tokenizer.tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(expected, str)
    assert prompt.token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.stats().rendered_directly == before + 1
    tools = {**body, "tools": [{"type": "function", "function": {"name": "f"}}]}
    tokenizer.chat(tools)  # tools: the tokenizer's call
    assert tokenizer.stats().rendered_directly == before + 1


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], {}),
        ([{"role": "assistant", "content": "a", "tool_calls": []}], {}),
        ([{"role": "assistant", "content": "a", "reasoning_content": "r"}], {}),
        ([{"role": "user", "content": None}], {}),
        ([{"role": "user", "content": "a"}], {"continue_final_message": True}),
        ([{"role": "user", "content": "a"}], {"tools": [{"type": "function"}]}),
        ([{"role": "user", "content": "a"}], {"documents": [{"text": "d"}]}),
        ([{"role": "user", "content": "a"}], {"enable_thinking": True}),
        ([{"role": "user", "content": "a"}], {"add_generation_prompt": "yes"}),
    ],
)
def test_anything_but_a_plain_chat_goes_to_the_tokenizer(
    messages: list[Any], kwargs: dict[str, Any]
) -> None:
    assert not plain(messages, kwargs)


def test_a_template_that_differs_or_does_not_compile_stays_on_the_tokenizer() -> None:
    def other(*args: Any, **kwargs: Any) -> str:
        return "something else"

    direct = DirectTemplates(other, {})
    chat = [{"role": "user", "content": "a"}]
    assert direct.render("{{ messages[0].content }}", chat, {}) is None
    assert "differently" in (direct.refused("{{ messages[0].content }}") or "")
    generation = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert direct.render(generation, chat, {}) is None
    assert "does not compile" in (direct.refused(generation) or "")
    assert direct.rendered == 0
