"""A model's chat template rendered by jinja2 directly, for the plain chats most requests are.

The engine renders a chat with its tokenizer's ``apply_chat_template``, and so does the front
door (:class:`~kvevents.route.ModelTokenizer`). Before it reaches the template, that call
rebuilds every message out of plain JSON types, drops keys whose value is None, copies
reasoning under the names templates read, and sets up its keyword arguments: about 90 us of a
two-message chat, three quarters of the rendering. For a chat whose messages are already plain
(each a role and a string content, perhaps a name; no tools, documents, reasoning or
``continue_final_message``) none of that changes what the template sees, so the template is
rendered here by jinja2 itself, in an environment set up as the engines' is: sandboxed and
immutable, ``trim_blocks`` and ``lstrip_blocks``, the loop controls, a ``tojson`` filter that
keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, and the tokenizer's named
special tokens (``bos_token``, ``eos_token``...) as variables.

A template takes this path only after it rendered a set of probe chats (one to four turns,
with and without a generation prompt, unicode and special-token strings in the text) exactly
as the tokenizer's own call does; a template that differs on any, does not compile here (a
``{% generation %}`` block) or raises on one and not the other stays on the tokenizer's call.
Any chat outside the plain shape, and any render that raises here, goes there too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvevents._types import Document, DocumentView, JSONValue

__all__ = ["DirectTemplates"]

#: The message keys a plain chat may have.
_PLAIN_KEYS = frozenset({"role", "content", "name"})
#: The keyword arguments of a plain render and the values they must have.
_PLAIN_KWARGS = {"tools": None, "documents": None, "continue_final_message": False}
_MAX_TEMPLATES = 8

#: Chats the direct render must give exactly as the tokenizer's call before it is used.
_PROBES: tuple[list[Document], ...] = (
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Un"},
        {"role": "user", "content": "Two  \n\n and a half"},
    ],
    [
        {"role": "user", "content": "ünïcödé 漢字 🙂 \u200b\t<|im_end|></s><|eot_id|>"},
        {"role": "assistant", "content": " {{ not a tag }} {% nor this %}", "name": "bot"},
    ],
    [{"role": "user", "content": ""}],
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: JSONValue,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def plain(messages: Sequence[DocumentView], kwargs: DocumentView) -> bool:
    """Whether a chat and its call's arguments are of the shape this path renders."""
    for name, value in kwargs.items():
        if name == "add_generation_prompt":
            if not isinstance(value, bool):
                return False
        elif name not in _PLAIN_KWARGS or value != _PLAIN_KWARGS[name]:
            return False
    for message in messages:
        if not _PLAIN_KEYS.issuperset(message):
            return False
        for value in message.values():
            if type(value) is not str:
                return False
    return True


class DirectTemplates:
    """Templates rendered by jinja2 directly, each once proven on the probes against
    ``apply_chat_template`` (a callable taking the tokenizer's arguments).

    ``variables``: the tokenizer's named special tokens. :attr:`rendered` counts the chats
    rendered here; :meth:`refused` says why a template is not.
    """

    def __init__(self, apply_chat_template: Callable[..., object], variables: DocumentView) -> None:
        self._apply = apply_chat_template
        self._variables = dict(variables)
        self._env = _environment()
        self._templates: dict[str, jinja2.Template | str] = {}
        self.rendered = 0

    def render(
        self, template: str, messages: Sequence[DocumentView], kwargs: DocumentView
    ) -> str | None:
        """The chat's text, or None when it is for the tokenizer's call (see the module)."""
        if not plain(messages, kwargs):
            return None
        compiled = self._templates.get(template)
        if compiled is None:
            compiled = self._prove(template)
        if isinstance(compiled, str):
            return None
        try:
            text = compiled.render(
                self._variables,
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=kwargs.get("add_generation_prompt", False),
            )
        except Exception:  # the tokenizer's call raises its own error for it, or renders it
            return None
        self.rendered += 1
        return text

    def refused(self, template: str) -> str | None:
        """Why ``template`` is not rendered here (None: it is, or was not tried yet)."""
        compiled = self._templates.get(template)
        return compiled if isinstance(compiled, str) else None

    def _prove(self, template: str) -> jinja2.Template | str:
        if len(self._templates) >= _MAX_TEMPLATES:
            self._templates.clear()
        outcome: jinja2.Template | str
        try:
            compiled = self._env.from_string(template)
        except jinja2.exceptions.TemplateError as exc:
            outcome = f"does not compile here: {type(exc).__name__}: {exc}"
        else:
            outcome = self._differs(compiled, template) or compiled
        self._templates[template] = outcome
        return outcome

    def _differs(self, compiled: jinja2.Template, template: str) -> str | None:
        """Why the direct render differs from the tokenizer's call on a probe (None: never)."""
        for probe in _PROBES:
            for generation in (True, False):
                ours = _outcome(
                    partial(
                        compiled.render,
                        self._variables,
                        messages=probe,
                        tools=None,
                        documents=None,
                        add_generation_prompt=generation,
                    )
                )
                theirs = _outcome(
                    partial(
                        self._apply,
                        [dict(m) for m in probe],
                        tools=None,
                        chat_template=template,
                        tokenize=False,
                        add_generation_prompt=generation,
                        continue_final_message=False,
                    )
                )
                if ours != theirs:
                    return f"renders a probe chat differently ({len(probe)} messages)"
        return None


def _outcome(call: Callable[[], object]) -> tuple[bool, object]:
    """(raised, text) of ``call()``: a template that refuses a probe must refuse it both ways."""
    try:
        return False, call()
    except Exception:  # whatever a template raises on an input it refuses
        return True, None
