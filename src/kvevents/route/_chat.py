"""A chat request's template inputs, prepared the way vLLM 0.32's OpenAI server prepares them.

vLLM (its default "hf" renderer) turns ``/v1/chat/completions`` bodies into one call of
``tokenizer.apply_chat_template(conversation, tools=..., chat_template=..., tokenize=False,
**kwargs)`` and then encodes the text with ``add_special_tokens`` (default False for chats).
This module rebuilds, from the JSON body, exactly what that call receives. The facts it
follows (read from vLLM 0.32's ``renderers/chat_utils.py``, ``renderers/hf.py``,
``renderers/params.py``, ``renderers/online_renderer.py`` and its request models):

- Message content: a string is one text part; ``None`` no parts. The template's content format
  is detected from the template (:func:`content_format`): ``"string"`` (text parts joined with
  ``\\n``) or ``"openai"`` (a list of ``{"type": "text", "text": ...}`` dicts, with the part's
  unknown fields kept). Text part types: ``text``, ``input_text``, ``output_text`` (their
  ``text``), ``refusal``, ``thinking``; a ``text``/``refusal`` part without its value is
  skipped; ``tool_reference`` gives its ``name``. System messages drop a first line starting
  with ``x-anthropic-billing-header``.
- The conversation message: ``role``, ``content``, then for an assistant its ``tool_calls``
  (as validated: keys ``id``, ``function`` {``arguments``, ``name``, ...}, ``type``, then unknown
  keys) with JSON ``arguments`` decoded (not an object, invalid or empty: ``{}``; empty
  ``tool_calls`` dropped) and its reasoning under ``reasoning`` and ``reasoning_content``
  (``reasoning_content`` in the request is read as ``reasoning``); for a tool message its
  ``tool_call_id`` and, in the openai format, text parts joined; ``name`` and ``task`` when
  strings; for a developer message its ``tools``.
- Developer messages become system messages (``tools`` dropped) when the template never names
  the ``"developer"`` role, and then every system message is merged into one first message
  (contents joined with a blank line) if there is more than one or it is not first.
- Tools: each as its validated model dumps it: ``{"type": "function", "function": {"name",
  "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}``;
  omitted when ``tool_choice`` is ``"none"`` and the engine runs with
  ``--exclude-tools-when-tool-choice-none``.
- Template variables: the request's ``chat_template_kwargs``, overridden by
  ``add_generation_prompt`` (default True), ``continue_final_message`` (default False),
  ``documents`` and ``reasoning_effort`` when given (and ``enable_thinking =
  reasoning_effort != "none"`` unless the kwargs set it); the engine's
  ``--default-chat-template-kwargs`` under all of them; ``None`` values dropped; a
  ``tools`` kwarg replaces the request's tools.

What cannot be rebuilt here raises :class:`NoTokens` with the reason: ``refused`` when the
engine answers such a request with an error (no tokens exist), else the caller asks the
engine's ``/tokenize``. Multimodal parts are never rebuilt (``multimodal``).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

__all__ = [
    "ChatOptions",
    "NoTokens",
    "content_format",
    "conversation",
    "developer_as_system",
    "template_kwargs",
    "tool_dicts",
    "version_sensitive",
]

ContentFormat = Literal["string", "openai"]

# Part types read as text, and which field holds their text.
_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Media part types (and the keys that mark a part without a type as media).
_MEDIA_PARTS = (
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "prompt_embeds",
)
# Text parts vLLM skips (with a warning) when their value is missing.
_SKIP_WHEN_EMPTY = {"text", "refusal"}
# Fields of the content part types vLLM knows; in the openai format a text part keeps the
# others (e.g. ``cache_control``).
_KNOWN_PART_FIELDS = frozenset(
    (
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    )
)
_REASONING_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh", "max")
# Roles whose content may be null (absent content is accepted for any role).
_NULL_CONTENT_ROLES = ("assistant", "function")
_BILLING_HEADER = "x-anthropic-billing-header"
# Names the engine's apply_chat_template (transformers 5.19 under vLLM 0.32) takes itself;
# any other request kwarg only reaches the template as a variable.
_ENGINE_CALL_PARAMETERS = frozenset(
    (
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "self",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    )
)
# Of those, the ones that change nothing when the call renders text (tokenize=False).
_INERT_WITHOUT_TOKENIZE = frozenset(
    ("max_length", "padding", "return_dict", "return_tensors", "tokenizer_kwargs", "truncation")
)


class NoTokens(Exception):
    """The request's tokens cannot be rebuilt here; ``why`` says what stopped it.

    ``refused``: the engine answers the request with an error, so no tokens exist and asking
    its ``/tokenize`` is pointless. ``multimodal``: the request has media parts.
    """

    def __init__(self, why: str, *, refused: bool = False, multimodal: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.refused = refused
        self.multimodal = multimodal


def _refuse(why: str) -> NoTokens:
    return NoTokens(why, refused=True)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NoTokens(f"{name} is not a boolean")
    return value


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _refuse(f"{name} is not a {kind.__name__}")
    return value


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The request fields, other than messages and tools, that change a chat's tokens."""

    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any]
    documents: list[Any] | None
    reasoning_effort: str | None

    @classmethod
    def read(cls, body: Mapping[str, Any]) -> ChatOptions:
        """The options of ``body``; :class:`NoTokens` for a value of the wrong kind."""
        options = cls(
            add_generation_prompt=_flag(body, "add_generation_prompt", True),
            continue_final_message=_flag(body, "continue_final_message", False),
            add_special_tokens=_flag(body, "add_special_tokens", False),
            chat_template=_optional(body, "chat_template", str),
            chat_template_kwargs=_optional(body, "chat_template_kwargs", dict) or {},
            documents=_optional(body, "documents", list),
            reasoning_effort=_optional(body, "reasoning_effort", str),
        )
        if options.reasoning_effort not in _REASONING_EFFORTS:
            raise _refuse(f"reasoning_effort {options.reasoning_effort!r}")
        if options.add_generation_prompt and options.continue_final_message:
            raise _refuse("continue_final_message with add_generation_prompt")
        return options


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's merge: ``defaults`` updated by the overrides that are not None or "auto"."""
    return {**defaults, **{k: v for k, v in overrides.items() if v is not None and v != "auto"}}


def request_kwargs(options: ChatOptions) -> dict[str, Any]:
    """The request's own template kwargs: its ``chat_template_kwargs`` under its flags."""
    extra: dict[str, Any] = {
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final_message,
        "documents": options.documents,
        "reasoning_effort": options.reasoning_effort,
    }
    user = options.chat_template_kwargs
    if options.reasoning_effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = options.reasoning_effort != "none"
    return _merge(user, extra)


def template_kwargs(
    options: ChatOptions,
    tools: list[dict[str, Any]] | None,
    engine_defaults: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything the engine's chat template call receives besides the conversation.

    Keys ``tools`` and ``chat_template`` included (None when absent); ``tokenize`` is refused
    (it changes how the engine tokenizes) like the call's own machinery arguments.
    """
    defaults = _merge(engine_defaults, {"tools": tools})
    merged = _merge(defaults, request_kwargs(options))
    for name in ("tokenize", "conversation", "self", "chat_template"):
        if name in merged:
            raise NoTokens(f"chat_template_kwargs.{name} changes how the engine renders")
    if merged.get("return_assistant_tokens_mask"):
        raise _refuse("chat_template_kwargs.return_assistant_tokens_mask needs tokenize")
    merged = {k: v for k, v in merged.items() if k not in _INERT_WITHOUT_TOKENIZE}
    merged.setdefault("tools", None)
    return merged


def foreign_parameters(kwargs: Mapping[str, Any], ours: frozenset[str]) -> str | None:
    """A kwarg our apply_chat_template takes as a parameter but the engine's does not."""
    return next((k for k in kwargs if k in ours and k not in _ENGINE_CALL_PARAMETERS), None)


def _function(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _refuse(f"{where}.function has no name")
    dumped: dict[str, Any] = {"name": value["name"]}
    for name, kind in (("description", str), ("parameters", dict)):
        item = value.get(name)
        if item is not None and not isinstance(item, kind):
            raise NoTokens(f"{where}.function.{name} is not a {kind.__name__}")
        dumped[name] = item
    for name in ("strict", "defer_loading"):
        item = value.get(name)
        if item is not None and not isinstance(item, bool):
            raise NoTokens(f"{where}.function.{name} is not a boolean")
        if item is not None:
            dumped[name] = item
    return dumped


def _tool(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise _refuse(f"{where} is not a function tool")
    defer = value.get("defer_loading")
    if defer is not None and not isinstance(defer, bool):
        raise NoTokens(f"{where}.defer_loading is not a boolean")
    function = _function(value.get("function"), where)
    if defer is not None and "defer_loading" not in function:
        function["defer_loading"] = defer
    dumped: dict[str, Any] = {"type": "function", "function": function}
    if defer is not None:
        dumped["defer_loading"] = defer
    return dumped


def tool_choice(body: Mapping[str, Any]) -> Any:
    """The request's ``tool_choice`` as vLLM reads it: ``"auto"`` when tools come without one."""
    if "tool_choice" in body:
        return body["tool_choice"]
    return "auto" if body.get("tools") else "none"


def check_tool_choice(
    body: Mapping[str, Any], *, auto_tool_choice: bool, tool_parser: bool
) -> None:
    """Refuse what vLLM refuses: empty tools, a choice without tools or naming no tool, and
    ``auto`` (``required``, a named tool) without ``--enable-auto-tool-choice``
    (``--tool-call-parser``)."""
    tools, choice = body.get("tools"), tool_choice(body)
    if tools == []:
        raise _refuse("tools is an empty list")
    if choice is None or choice == "none":
        return
    if tools is None:
        raise _refuse("tool_choice without tools")
    if isinstance(choice, dict):
        name = (
            (choice.get("function") or {}).get("name")
            if isinstance(choice.get("function"), dict)
            else None
        )
        names = {
            t.get("function", {}).get("name")
            for t in tools
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
        }
        if not isinstance(name, str) or name not in names:
            raise _refuse("tool_choice names no given tool")
    elif choice not in ("auto", "required"):
        raise _refuse(f"tool_choice {choice!r}")
    if choice == "auto" and not (auto_tool_choice and tool_parser):
        raise _refuse('tool_choice "auto" without --enable-auto-tool-choice')
    if choice != "auto" and not tool_parser:
        raise _refuse("tool_choice required or named without --tool-call-parser")


def tool_dicts(
    body: Mapping[str, Any], *, exclude_when_none: bool = False
) -> list[dict[str, Any]] | None:
    """The request's tools as the engine hands them to the template."""
    tools = body.get("tools")
    if tools is None or (exclude_when_none and tool_choice(body) == "none"):
        return None
    if not isinstance(tools, list):
        raise _refuse("tools is not a list")
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _text_part(part: dict[str, Any], kind: str, fmt: ContentFormat) -> str | dict[str, Any] | None:
    text = part.get(_TEXT_FIELDS[kind])
    if text is None and kind in _SKIP_WHEN_EMPTY:
        return None
    if not isinstance(text, str):
        raise _refuse(f"a {kind} part has no text")
    if fmt == "string":
        return text
    extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
    return {"type": "text", "text": text, **extra}


def _part(part: Any, fmt: ContentFormat) -> str | dict[str, Any] | None:
    """One content part as the template sees it (None: skipped)."""
    if isinstance(part, str):
        return part if fmt == "string" else {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise _refuse("a content part is not an object")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        media = next((key for key in _MEDIA_PARTS if key in part), None)
        if media is None:
            raise _refuse("a content part without a type")
        raise NoTokens(f"{media} part", multimodal=True)
    if kind in _TEXT_FIELDS:
        return _text_part(part, kind, fmt)
    if kind == "tool_reference":
        name = part.get("name")
        return name if fmt == "string" else {"type": kind, "name": name}
    if kind in _MEDIA_PARTS:
        raise NoTokens(f"{kind} part", multimodal=True)
    raise _refuse(f"unsupported content part type {kind!r}")


def _content(role: str, content: Any, fmt: ContentFormat) -> str | list[Any]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise _refuse(f"{role} message content is neither text nor parts")
    if role == "system":
        parts = _strip_billing_header(parts)
    # vLLM keeps only truthy parts: an empty text part vanishes (no extra newline).
    rendered = [p for p in (_part(part, fmt) for part in parts) if p]
    if fmt == "string":
        return "\n".join(rendered)  # type: ignore[arg-type]  # string format: all str
    return rendered


def _arguments(value: Any) -> dict[str, Any]:
    """Tool call arguments as the template sees them: a decoded JSON object, else ``{}``."""
    if not value:
        return {}
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _validated(value: dict[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """A dict with its declared keys first (in declaration order), then the others."""
    head = {k: value[k] for k in order if k in value}
    return {**head, **{k: v for k, v in value.items() if k not in head}}


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if (
        not isinstance(call, dict)
        or call.get("type") != "function"
        or not isinstance(call.get("id"), str)
    ):
        raise _refuse(f"{where} is not a function call with an id")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _refuse(f"{where}.function has no name")
    if not isinstance(function.get("arguments"), str):
        raise _refuse(f"{where}.function.arguments is not a string")
    function = _validated(function, ("arguments", "name"))
    function["arguments"] = _arguments(function["arguments"])
    return {**_validated(call, ("id", "function", "type")), "function": function}


def _tool_calls(message: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise _refuse("tool_calls is not a list")
    return [_tool_call(call, f"tool_calls[{i}]") for i, call in enumerate(calls)] or None


def _reasoning(message: Mapping[str, Any]) -> Any:
    reasoning = message.get("reasoning")
    return message.get("reasoning_content") if reasoning is None else reasoning


def _tool_content(content: str | list[Any]) -> str | list[Any]:
    if isinstance(content, str) or any(part.get("type") != "text" for part in content):
        return content
    return "\n".join(part.get("text", "") for part in content)


def _message(message: Any, fmt: ContentFormat) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _refuse("a message without a role")
    role = message["role"]
    if "content" in message and message["content"] is None and role not in _NULL_CONTENT_ROLES:
        raise _refuse(f"a {role} message with null content")
    result: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), fmt)}
    if role == "assistant":
        if (calls := _tool_calls(message)) is not None:
            result["tool_calls"] = calls
        if (reasoning := _reasoning(message)) is not None:
            if not isinstance(reasoning, str):
                raise NoTokens("reasoning is not a string")
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            if not isinstance(message["tool_call_id"], (str, type(None))):
                raise _refuse("tool_call_id is not a string")
            result["tool_call_id"] = message["tool_call_id"]
        result["content"] = _tool_content(result["content"])
    if "name" in message and not isinstance(message["name"], str):
        raise _refuse("a message name is not a string")
    for name in ("name", "task"):
        if isinstance(message.get(name), str):
            result[name] = message[name]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def conversation(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages as the template receives them."""
    if not isinstance(messages, list) or not messages:
        raise _refuse("messages is not a non-empty list")
    return [_message(message, fmt) for message in messages]


def _system_text(content: Any) -> str:
    if not isinstance(content, list):
        return content or ""
    texts = [
        p["text"] if isinstance(p, dict) else p
        for p in content
        if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
    ]
    return "\n".join(texts)


def developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Developer messages as system messages (and systems merged) for templates without them."""
    if '"developer"' in template or "'developer'" in template:
        return messages
    if not any(m["role"] == "developer" for m in messages):
        return messages
    converted = [
        {k: v for k, v in {**m, "role": "system"}.items() if k != "tools"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = [t for i in systems if (t := _system_text(converted[i].get("content", "")))]
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _names(template: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", template) is not None


def version_sensitive(messages: Sequence[Mapping[str, Any]], template: str) -> str | None:
    """Why this conversation may render differently under another transformers version.

    Since 5.24 ``apply_chat_template`` drops message keys whose value is None and copies a
    message's reasoning to ``thinking``; 5.19 (vLLM 0.32's CPU build) does neither. When the
    template can see the difference (it names the key, or walks a message's ``items()``),
    only the engine can say what it renders.
    """
    walks = "items()" in template
    for message in messages:
        for key, value in message.items():
            if value is None and (walks or _names(template, key)):
                return f"a message's {key} is null (transformers versions render it differently)"
        if "reasoning" in message and (walks or _names(template, "thinking")):
            return "reasoning under a template reading `thinking` (transformers versions differ)"
    return None


class _GenerationTag(jinja2.ext.Extension):
    """Parses ``{% generation %}`` blocks (transformers' assistant-mask tag) as plain output."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


_ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)


class _Undecidable(Exception):
    """vLLM's detection gives up on this template (and then uses the "string" format)."""


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads variable ``name`` (or its ``key``), maybe through filters, tests, slices."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _reads(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    return isinstance(node, jinja2.nodes.Getattr) and _reads(node.node, name) and node.attr == key


def _target(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _Undecidable
    return node.name


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (transitively)."""
    found, queue = [name], deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _reads(assign.node, current):
                target = _target(assign.target)
                if target not in found:
                    found.append(target)
                    queue.append(target)
    return found


def _loop_targets(
    root: jinja2.nodes.Node, sources: Sequence[str], key: str | None = None
) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, source, key) for source in sources):
            yield _target(loop.target)


def _macro_content_params(
    root: jinja2.nodes.Template, messages: Sequence[str]
) -> dict[int, set[str]]:
    """Loops inside macros (by id) -> the macro parameters that receive a message's content."""
    found: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        receiving: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(params)]):
                if any(_reads(arg, m, "content") for m in messages):
                    receiving.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_reads(kw.value, m, "content") for m in messages):
                    receiving.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            found[id(loop)] = receiving
    return found


def _walks_content(root: jinja2.nodes.Template) -> bool:
    messages = list(_loop_targets(root, _aliases(root, "messages")))
    in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            _target(loop.target)
            return True
        iterated = loop.iter.name if isinstance(loop.iter, jinja2.nodes.Name) else None
        if iterated is not None and iterated in in_macros.get(id(loop), set()):
            _target(loop.target)
            return True
        if iterated == "content" and id(loop) not in in_macros:
            _target(loop.target)
            return True
    return False


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``.

    The same rules as vLLM's detection: a ``for`` over ``message.content`` (or
    ``message['content']``, maybe filtered or sliced) where ``message`` is a loop variable over
    ``messages`` or a variable assigned from it; over a macro parameter that receives a
    message's content; or over a variable named ``content`` outside macros. A template that
    does not parse, or whose loops unpack tuples, is "string".
    """
    try:
        return "openai" if _walks_content(_ENVIRONMENT.parse(template)) else "string"
    except (jinja2.TemplateSyntaxError, _Undecidable):
        return "string"
