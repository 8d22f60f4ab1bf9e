"""A served model's exact prompt tokens, in process: chats rendered and prompts encoded as vLLM does.

:class:`ModelTokenizer` loads the model's own tokenizer and chat template with Hugging Face
``transformers`` (from a directory, or a model id already in the local cache: never a
download) and gives, for a ``/v1/chat/completions`` or ``/v1/completions`` body, the token ids
vLLM 0.32's OpenAI server runs (its default "hf" renderer): the same ``apply_chat_template``
call with the same arguments (:mod:`kvevents.route._chat` rebuilds them), then the same encode
(``add_special_tokens`` False for chats, True for completions, as the request says),
``truncate_prompt_tokens`` and ``truncation_side`` as the engine applies them, and
``kv_transfer_params.prompt_token_ids`` taken as given. Text is encoded through a cache of the
pieces between added tokens (:mod:`kvevents.route._segments`): later turns of a chat cost
little, and the ids are the whole-text encode's.

Each answer is a :class:`Prompt`: the ids, or none with the reason and what to do:

- ``source="fallback"``: the engine can say (one ``/tokenize`` call to one engine, built by
  :func:`tokenize_request`, read by :func:`parse_tokenize_reply`). Used for multimodal parts
  (their placeholders expand in the engine's processor; the ids are then not enough for cache
  keys either: ``multimodal``), a template that fails to render here, request fields of a type
  the engine would coerce, ``chat_template_kwargs`` that change how the engine calls the
  template (``tokenize``, ``chat_template``, parameters only newer transformers take), null
  message fields or reasoning under a template that can see how transformers versions differ
  (5.19 keeps null keys and adds no ``thinking``; 5.24 drops and adds), gpt-oss (Harmony) and
  Mistral (``mistral_common``) models, whose chats vLLM does not render with the template.
- ``source="none"``: nobody can (the engine answers the request with an error, takes prompt
  embeddings, or truncates a prompt ``/tokenize`` would not); route on load alone.

Not reproduced, and so never claimed: ``--tokenizer-mode`` other than ``auto``/``hf``, renderers for DeepSeek V3.2/V4, Kimi K3 and
Cohere, and a model whose processor (multimodal models) has its own chat template file other
than ``chat_template.json``. Pass the engine flags that do change tokens as
:class:`EngineOptions`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from kvevents._types import Document, DocumentView, JSONValue
from kvevents.errors import TokenizerNotFound
from kvevents.route._chat import (
    ChatOptions,
    NoTokens,
    check_tool_choice,
    content_format,
    conversation,
    developer_as_system,
    foreign_parameters,
    request_kwargs,
    template_kwargs,
    tool_choice,
    tool_dicts,
    version_sensitive,
)
from kvevents.route._segments import Encoder
from kvevents.route._template import DirectTemplates

__all__ = [
    "EngineOptions",
    "ModelTokenizer",
    "Prompt",
    "TokenizerStats",
    "parse_tokenize_reply",
    "tokenize_request",
]

#: A Hugging Face tokenizer (fast or slow): transformers declares no one type for them all.
HFTokenizer: TypeAlias = Any

Source = Literal["chat", "completion", "tokens", "fallback", "none"]


def _import_transformers() -> Any:  # the transformers module (untyped), loaded on first use
    """``transformers``, imported without its "PyTorch was not found" advice.

    transformers logs that advice once, on import, unless ``TRANSFORMERS_NO_ADVISORY_WARNINGS``
    is set; the router never needs torch, so the variable is set for that import only.
    """
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    previous = os.environ.get(_NO_ADVICE)
    os.environ[_NO_ADVICE] = "1"
    try:
        import transformers
    finally:
        if previous is None:
            os.environ.pop(_NO_ADVICE, None)
        else:
            os.environ[_NO_ADVICE] = previous
    return transformers


_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt's tokens as the engine will see them, or why they are not known here."""

    #: The ids; None when they cannot be exact in process (see ``source``).
    token_ids: Sequence[int] | None
    #: ``chat`` (rendered and encoded), ``completion`` (encoded text), ``tokens`` (given as
    #: ids), ``fallback`` (ask one engine's ``/tokenize``), ``none`` (no tokens to be had).
    source: Source
    #: Why there are no ids (``"image_url part"``, ``"template error: ..."``), else None.
    why: str | None = None
    #: The request has media parts: ids alone do not make the engine's cache keys.
    multimodal: bool = False


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The engine's flags that change a prompt's tokens (the defaults: a plain ``vllm serve``)."""

    #: ``--chat-template``: the template's text or a file holding it.
    chat_template: str | None = None
    #: ``--default-chat-template-kwargs``.
    default_chat_template_kwargs: DocumentView | None = None
    #: ``--trust-request-chat-template`` (else a request's ``chat_template`` is refused).
    trust_request_chat_template: bool = False
    #: ``--exclude-tools-when-tool-choice-none``.
    exclude_tools_when_tool_choice_none: bool = False
    #: ``--enable-auto-tool-choice`` (``tool_choice: "auto"``, the default with tools).
    enable_auto_tool_choice: bool = False
    #: ``--tool-call-parser`` (needed by every tool choice but "none").
    tool_call_parser: str | None = None
    #: ``--chat-template-content-format`` ("auto": detected from the template, as vLLM does).
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    #: ``--max-model-len``: needed for ``truncate_prompt_tokens=-1``; longer prompts are refused.
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class TokenizerStats:
    """Counts since load: prompts answered by source, and the piece cache."""

    chat: int
    completion: int
    tokens: int
    fallback: int
    none: int
    #: Pieces held, lookups that hit, lookups that missed (0 when the cache is off).
    cache_pieces: int
    cache_hits: int
    cache_misses: int
    #: Why pieces are not cached for this tokenizer (None: they are).
    uncached: str | None
    #: Chats rendered by jinja2 directly rather than by the tokenizer's call
    #: (:mod:`kvevents.route._template`).
    rendered_directly: int = 0


@dataclass(slots=True)
class _SourceCounts:
    """Prompts answered by source (the first fields of :class:`TokenizerStats`): mutable
    fields, so that a counter's name is checked by mypy."""

    chat: int = 0
    completion: int = 0
    tokens: int = 0
    fallback: int = 0
    none: int = 0

    def add(self, source: Source) -> None:
        if source == "chat":
            self.chat += 1
        elif source == "completion":
            self.completion += 1
        elif source == "tokens":
            self.tokens += 1
        elif source == "fallback":
            self.fallback += 1
        else:
            self.none += 1


@dataclass(frozen=True, slots=True)
class _Limits:
    """``truncate_prompt_tokens``, ``truncation_side`` and the engine's length bounds."""

    keep: int | None
    side: Literal["left", "right"] | None
    max_model_len: int | None
    output_tokens: int

    @classmethod
    def read(cls, body: DocumentView, *, chat: bool, max_model_len: int | None) -> _Limits:
        """The limits of a request body (chats count ``max_completion_tokens`` first)."""
        keep, side = body.get("truncate_prompt_tokens"), body.get("truncation_side")
        if keep is not None and (type(keep) is not int or keep < -1):
            raise NoTokens("truncate_prompt_tokens is not an integer >= -1", refused=True)
        if side not in (None, "left", "right"):
            raise NoTokens("truncation_side is not 'left' or 'right'", refused=True)
        output = body.get("max_completion_tokens") if chat else None
        if output is None:
            output = body.get("max_tokens", None if chat else 16)  # completions default to 16
        if output is not None and type(output) is not int:
            raise NoTokens("max_tokens is not an integer")
        limits = cls(keep, side, max_model_len, output or 0)
        if max_model_len is not None and limits.output_tokens > max_model_len:
            raise NoTokens("max_tokens exceeds max_model_len", refused=True)
        if max_model_len is not None and keep is not None and keep > max_model_len:
            raise NoTokens("truncate_prompt_tokens exceeds max_model_len", refused=True)
        return limits

    def length(self) -> int | None:
        """How many tokens truncation keeps (None: no truncation)."""
        if self.keep is None or self.keep >= 0:
            return self.keep
        if self.max_model_len is None:
            raise NoTokens(
                "truncate_prompt_tokens=-1 needs the engine's max_model_len", refused=True
            )
        return self.max_model_len if self.output_tokens == 0 else max(0, self.max_model_len - 1)


def _load_hf(source: str | Path) -> HFTokenizer:
    """The tokenizer, as vLLM loads it (left truncation side for generation)."""
    auto_tokenizer = _import_transformers().AutoTokenizer

    text = str(source)
    looks_local = (
        isinstance(source, Path) or text.startswith((".", "/", "~")) or Path(text).exists()
    )
    path = Path(text).expanduser()
    if looks_local and not path.is_dir():
        raise TokenizerNotFound(text, "no such directory")
    try:
        return auto_tokenizer.from_pretrained(
            str(path) if looks_local else text, truncation_side="left", local_files_only=True
        )
    except (OSError, ValueError) as exc:
        where = "the directory holds no loadable tokenizer" if looks_local else _cache_hint()
        first = (str(exc).strip().splitlines() or [""])[0]
        raise TokenizerNotFound(text, f"{where} ({type(exc).__name__}: {first})") from None


def _cache_hint() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return "not in the local Hugging Face cache (nothing is downloaded)"
    return f"not in the local Hugging Face cache {HF_HUB_CACHE} (nothing is downloaded)"


def _model_files(tokenizer: HFTokenizer) -> Path | None:
    """The directory the tokenizer came from, when it is one (a cache snapshot included)."""
    path = Path(getattr(tokenizer, "name_or_path", "") or "")
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # no snapshot to read: the checks below just find nothing
        return None


def _renderer_reason(directory: Path | None) -> str | None:
    """Why vLLM would not render this model's chats with its template (None: it does)."""
    if directory is None:
        return None
    config = directory / "config.json"
    model_type = None
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
    if model_type == "gpt_oss":
        return "gpt-oss chats are rendered by Harmony, not the chat template"
    if (directory / "tekken.json").exists() or any(directory.glob("tokenizer.model.v*")):
        return "Mistral models are tokenized by mistral_common"
    return None


def _processor_template(directory: Path | None, tokenizer_template: JSONValue) -> str | None:
    """A processor's own chat template (``chat_template.json``), when it differs."""
    if directory is None or not (directory / "chat_template.json").is_file():
        return None
    try:
        template = json.loads((directory / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) and template != tokenizer_template else None


def _engine_template(option: str | None) -> str | None:
    if option is None:
        return None
    path = Path(option)
    try:
        return path.read_text() if path.is_file() else option
    except OSError:
        return option


def _wrap(tokenizer: HFTokenizer) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after a text (None: not a fixed wrap)."""
    wraps = set()
    for probe in ("a", "Hello world", " x\n y", "0123"):
        body = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        spots = [i for i in range(len(full) - len(body) + 1) if full[i : i + len(body)] == body]
        if len(spots) != 1:
            return None
        wraps.add((tuple(full[: spots[0]]), tuple(full[spots[0] + len(body) :])))
    if len(wraps) != 1:
        return None
    prefix, suffix = wraps.pop()
    return list(prefix), list(suffix)


def _encoder(tokenizer: HFTokenizer) -> Encoder | None:
    """A cached encoder that agrees with ``tokenizer`` on probes, or None (encode with it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    wrap = (
        _wrap(tokenizer) if backend is not None and getattr(tokenizer, "is_fast", False) else None
    )
    if wrap is None or backend is None:
        return None
    encoder = Encoder(
        backend,
        prefix=wrap[0],
        suffix=wrap[1],
        split_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
    )
    for probe in ("a b", "Hello\n\nworld", "ünïcödé 😀", "12345 x"):
        for special in (False, True):
            if (
                encoder.encode(probe, special)
                != tokenizer(probe, add_special_tokens=special)["input_ids"]
            ):
                return None
    encoder.reset_counts()
    return encoder


class ModelTokenizer:
    """Exact prompt tokens for one served model (and its LoRA adapters: vLLM uses the base
    model's tokenizer for them); see the module docstring for what falls back and why."""

    def __init__(
        self, tokenizer: HFTokenizer, *, model_name: str, options: EngineOptions | None = None
    ) -> None:
        self.model_name = model_name
        self.options = options or EngineOptions()
        self._tokenizer = tokenizer
        self._encoder = _encoder(tokenizer)
        directory = _model_files(tokenizer)
        self._why_not_template = _renderer_reason(directory)
        self._processor_template = _processor_template(
            directory, getattr(tokenizer, "chat_template", None)
        )
        self._engine_template = _engine_template(self.options.chat_template)
        self._parameters = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters)
        self._direct = DirectTemplates(
            tokenizer.apply_chat_template, dict(getattr(tokenizer, "special_tokens_map", {}))
        )
        self._max_chars = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self._counts = _SourceCounts()
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls, source: str | Path, *, model_name: str, options: EngineOptions | None = None
    ) -> ModelTokenizer:
        """From a directory or a model id in the local Hugging Face cache (never downloaded).

        :class:`~kvevents.errors.TokenizerNotFound` names the source when it is not there.
        """
        return cls(_load_hf(source), model_name=model_name, options=options)

    @property
    def tokenizer(self) -> HFTokenizer:
        """The Hugging Face tokenizer (for reading; changing it changes every answer)."""
        return self._tokenizer

    def stats(self) -> TokenizerStats:
        """Prompts answered by source since load, and the piece cache."""
        pieces, hits, misses = self._encoder.stats if self._encoder else (0, 0, 0)
        uncached = self._encoder.why_uncached if self._encoder else "not a fast tokenizer"
        with self._lock:
            counts = dataclasses.asdict(self._counts)
        return TokenizerStats(
            **counts,
            cache_pieces=pieces,
            cache_hits=hits,
            cache_misses=misses,
            uncached=uncached,
            rendered_directly=self._direct.rendered,
        )

    def count(self, text: str) -> int:
        """How many tokens ``text`` is (as a model's output: no special tokens added);
        :class:`ValueError` as :meth:`encode`."""
        return len(self.encode(text, add_special_tokens=False))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, the same as ``tokenizer(text, add_special_tokens=...)["input_ids"]``.

        :class:`ValueError` for text the tokenizer cannot take (a lone surrogate): the engine
        refuses it too.
        """
        if not _encodable(text):
            raise ValueError("the text has a lone surrogate, which the tokenizer refuses")
        if self._encoder is not None:
            return self._encoder.encode(text, add_special_tokens)
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as exc:
            raise NoTokens(str(exc), refused=True) from None

    def _answer(self, prompt: Prompt) -> Prompt:
        with self._lock:
            self._counts.add(prompt.source)
        return prompt

    def _no_tokens(self, exc: NoTokens) -> Prompt:
        source: Source = "none" if exc.refused else "fallback"
        return self._answer(Prompt(None, source, exc.why, multimodal=exc.multimodal))

    # -- chats --------------------------------------------------------------------------

    def chat(self, body: DocumentView) -> Prompt:
        """The prompt of a parsed ``/v1/chat/completions`` body."""
        try:
            reused = _reused_ids(body)
            if reused is not None:
                return self._answer(Prompt(reused, "tokens"))
            limits = _Limits.read(body, chat=True, max_model_len=self.options.max_model_len)
            text, options = self.render(body)
            ids = self._encode_limited(text, options.add_special_tokens, limits)
        except NoTokens as exc:
            if not exc.refused and body.get("truncate_prompt_tokens") is not None:
                exc = NoTokens(f"{exc.why}, and /tokenize does not truncate", refused=True)
            return self._no_tokens(exc)
        return self._answer(Prompt(ids, "chat"))

    def render(self, body: DocumentView) -> tuple[str, ChatOptions]:
        """The chat's text as the engine's template renders it (:class:`NoTokens` if not here)."""
        if self._why_not_template:
            raise NoTokens(self._why_not_template)
        options = ChatOptions.read(body)
        self._check_trust(options)
        check_tool_choice(
            body,
            auto_tool_choice=self.options.enable_auto_tool_choice,
            tool_parser=self.options.tool_call_parser is not None,
        )
        tools = tool_dicts(body, exclude_when_none=self.options.exclude_tools_when_tool_choice_none)
        kwargs = template_kwargs(options, tools, self.options.default_chat_template_kwargs or {})
        if (name := foreign_parameters(kwargs, self._parameters)) is not None:
            raise NoTokens(
                f"chat_template_kwargs.{name}: the engine's transformers may not take it"
            )
        tools = kwargs.pop("tools")
        template = self._template(options.chat_template, tools)
        fmt = self.options.chat_template_content_format
        parsed = conversation(
            body.get("messages"), content_format(template) if fmt == "auto" else fmt
        )
        messages = developer_as_system(parsed, template)
        if (why := version_sensitive(messages, template)) is not None:
            raise NoTokens(why)
        text = self._direct.render(template, messages, {**kwargs, "tools": tools})
        if text is not None:
            return text, options
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=template, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template raises whatever it likes on inputs it refuses
            raise NoTokens(f"template error: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise NoTokens("the template call did not give text")
        return text, options

    def _check_trust(self, options: ChatOptions) -> None:
        given = (
            options.chat_template is not None
            or options.chat_template_kwargs.get("chat_template") is not None
        )
        if given and not self.options.trust_request_chat_template:
            raise NoTokens(
                "a request chat_template without --trust-request-chat-template", refused=True
            )

    def _template(self, requested: str | None, tools: JSONValue) -> str:
        """The template text the engine uses for this request (vLLM's order of choice)."""
        given = requested or self._engine_template
        if given is None and tools is None and self._processor_template is not None:
            return self._processor_template
        try:
            template = self._tokenizer.get_chat_template(given, tools=tools)
        except (ValueError, KeyError, TypeError) as exc:
            raise NoTokens(f"no chat template: {exc}") from None
        if not isinstance(template, str):
            raise NoTokens("no chat template")
        return template

    # -- completions --------------------------------------------------------------------

    def completion(self, body: DocumentView) -> list[Prompt]:
        """The prompts of a parsed ``/v1/completions`` body, one per prompt of a batch.

        A body the engine refuses as a whole (no prompt, a mixed batch, ``suffix``, prompt
        embeddings) gives one ``source="none"`` record.
        """
        try:
            items = _completion_items(body)
            limits = _Limits.read(body, chat=False, max_model_len=self.options.max_model_len)
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise NoTokens("add_special_tokens is not a boolean")
        except NoTokens as exc:
            return [self._no_tokens(exc)]
        return [self._completion_one(item, special, limits) for item in items]

    def _completion_one(self, item: str | list[int], special: bool, limits: _Limits) -> Prompt:
        try:
            if isinstance(item, str):
                return self._answer(
                    Prompt(self._encode_limited(item, special, limits), "completion")
                )
            return self._answer(
                Prompt(self._checked(_sliced(list(item), limits), limits), "tokens")
            )
        except NoTokens as exc:
            return self._no_tokens(exc)

    # -- truncation and length, as the engine applies them -----------------------------

    def _encode_limited(self, text: str, special: bool, limits: _Limits) -> list[int]:
        """``text``'s ids after the engine's character bound, truncation and length check."""
        keep = limits.length()
        text = self._character_bound(text, keep, limits)
        ids = self._encode(text, special)
        if keep is not None and limits.side is None:
            ids = self._tokenizer_truncated(ids, keep, special)
        return self._checked(_sliced(ids, limits), limits)

    def _character_bound(self, text: str, keep: int | None, limits: _Limits) -> str:
        """The engine's cut (or refusal) of texts over ``max_model_len`` x the longest token."""
        if limits.max_model_len is None:
            if keep is not None and limits.side is not None and len(text) > keep * self._max_chars:
                # Cut by characters when over max_model_len x the longest token: unknowable
                # here, and max_model_len >= keep says it cannot happen below that.
                raise NoTokens(
                    "truncation_side on a text this long needs max_model_len", refused=True
                )
            return text
        bound = limits.max_model_len * self._max_chars
        if len(text) <= bound:
            return text
        if keep is None:
            raise NoTokens("the prompt text is longer than max_model_len allows", refused=True)
        if limits.side is None:
            return text
        return text[-bound:] if limits.side == "left" else text[:bound]

    def _checked(self, ids: list[int], limits: _Limits) -> list[int]:
        if not ids:
            raise NoTokens("the prompt is empty", refused=True)
        if limits.max_model_len is not None and len(ids) > limits.max_model_len:
            raise NoTokens("the prompt is longer than max_model_len", refused=True)
        return ids

    def _tokenizer_truncated(self, ids: list[int], keep: int, special: bool) -> list[int]:
        """The tokenizer's own truncation (left, as vLLM loads it): its added ids stay."""
        if len(ids) <= keep:
            return ids
        if not special:
            return ids[len(ids) - keep :]
        if self._encoder is None:
            raise NoTokens("truncation with a post-processor that is not a fixed wrap")
        prefix, suffix = self._encoder.prefix, self._encoder.suffix
        room = keep - len(prefix) - len(suffix)
        if room < 0:
            raise NoTokens(
                "truncate_prompt_tokens is shorter than the special tokens", refused=True
            )
        body = ids[len(prefix) : len(ids) - len(suffix)]
        return [*prefix, *body[len(body) - room :], *suffix]


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid unicode (no lone surrogates, which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sliced(ids: list[int], limits: _Limits) -> list[int]:
    """The engine's slice after tokenizing: to ``keep`` from ``truncation_side`` (left)."""
    keep = limits.length()
    if keep is None or keep >= len(ids):
        return ids
    if keep == 0:
        return []
    return ids[-keep:] if (limits.side or "left") == "left" else ids[:keep]


_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking", "tool_reference")
_MEDIA_KEYS = (
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


def _has_media(messages: JSONValue) -> bool:
    """vLLM's test for content it must render (and so not reuse forwarded ids)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and (
                any(key in part for key in _MEDIA_KEYS)
                or part.get("type", "text") not in _TEXT_PARTS
            ):
                return True
    return False


def _reused_ids(body: DocumentView) -> list[int] | None:
    """``kv_transfer_params.prompt_token_ids``, which vLLM runs instead of rendering."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("prompt_token_ids") is None or body.get("echo"):
        return None
    ids = params["prompt_token_ids"]
    if _has_media(body.get("messages")):
        return None
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise NoTokens(
            "kv_transfer_params.prompt_token_ids is not a list of token ids", refused=True
        )
    return list(ids)


def _is_ids(value: JSONValue) -> bool:
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def _completion_items(body: DocumentView) -> list[str | list[int]]:
    """The prompts of a completion body: strings and token lists (:class:`NoTokens` else)."""
    if body.get("prompt_embeds") is not None:
        raise NoTokens("prompt_embeds: the engine runs embeddings, not tokens", refused=True)
    if body.get("suffix") is not None:
        raise NoTokens("suffix: the engine renders fill-in-the-middle for few models", refused=True)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise NoTokens("the prompt is empty", refused=True)
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise NoTokens("no prompt", refused=True)
    if _is_ids(prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt):
        return list(prompt)
    raise NoTokens("a prompt batch that is neither all strings nor all token lists", refused=True)


# -- the one fallback: an engine's /tokenize --------------------------------------------


def _chat_template_kwargs(body: DocumentView) -> JSONValue:
    """The kwargs ``/tokenize`` needs to render what the chat endpoint renders.

    ``/tokenize`` takes no ``documents`` or ``reasoning_effort``: they go in as the chat
    endpoint passes them to the template (``enable_thinking`` too).
    """
    kwargs = body.get("chat_template_kwargs")
    try:
        return request_kwargs(ChatOptions.read(body))
    except NoTokens:
        return kwargs


def tokenize_request(
    body: DocumentView,
    kind: Literal["chat", "completion"],
    *,
    index: int = 0,
    exclude_tools_when_tool_choice_none: bool = False,
) -> bytes:
    """The body of the one ``POST /tokenize`` that gives what the engine runs for ``body``.

    ``kind="chat"``: the messages with every option that changes the rendering (tools left
    out when the engine would leave them out). ``kind="completion"``: the text prompt at
    ``index`` of a batch (``/tokenize`` takes one text; token lists need no call:
    :class:`ValueError`). The values are passed on as the client sent them, so the engine
    judges them as it would have.
    """
    if kind == "completion":
        return json.dumps(_completion_tokenize(body, index)).encode()
    request: Document = {"model": body.get("model"), "messages": body.get("messages")}
    for name in (
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template",
    ):
        if body.get(name) is not None:
            request[name] = body[name]
    kwargs = _chat_template_kwargs(body)
    if kwargs is not None:
        request["chat_template_kwargs"] = kwargs
    excluded = exclude_tools_when_tool_choice_none and tool_choice(body) == "none"
    if body.get("tools") is not None and not excluded:
        request["tools"] = body["tools"]
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(name) is not None:
            request[name] = body[name]
    return json.dumps(request).encode()


def _completion_tokenize(body: DocumentView, index: int) -> Document:
    prompt = body.get("prompt")
    item = prompt[index] if isinstance(prompt, list) and not _is_ids(prompt) else prompt
    if index and not isinstance(prompt, list):
        raise ValueError(f"prompt {index} of a single prompt")
    if not isinstance(item, str):
        raise ValueError(f"prompt {index} is not text: token ids need no /tokenize")
    request = {"model": body.get("model"), "prompt": item}
    if body.get("add_special_tokens") is not None:
        request["add_special_tokens"] = body["add_special_tokens"]
    return request


def parse_tokenize_reply(data: bytes) -> list[int]:
    """The ids of a ``/tokenize`` answer; :class:`ValueError` saying what is wrong otherwise."""
    try:
        reply = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"/tokenize reply is not JSON: {exc}") from None
    if not isinstance(reply, dict):
        raise ValueError("/tokenize reply is not an object")
    if "error" in reply and "tokens" not in reply:
        raise ValueError(f"/tokenize answered an error: {str(reply['error'])[:300]}")
    tokens = reply.get("tokens")
    if not isinstance(tokens, list) or not _is_ids(tokens):
        raise ValueError("/tokenize reply has no list of token ids under 'tokens'")
    if "count" in reply and reply["count"] != len(tokens):
        raise ValueError(
            f"/tokenize reply counts {reply['count']!r} tokens but lists {len(tokens)}"
        )
    return list(tokens)
