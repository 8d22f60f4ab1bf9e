"""A stream continued on another engine: which requests can be, the request that continues
one, what the client was sent, and the continuation's events spliced onto its stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvevents.route._parse import route_request
from kvevents.route._resume import Splice, Transcript, continuable

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _request(path: str, **fields: Any) -> Any:
    document = {"model": "m", "stream": True, **fields}
    if path == CHAT:
        document.setdefault("messages", MESSAGES)
    else:
        document.setdefault("prompt", "once upon")
    return route_request(path, json.dumps(document).encode(), [])


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(text: str | None = None, *, rid: str = "chatcmpl-a", **delta: Any) -> bytes:
    if text is not None:
        delta["content"] = text
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return _event({"id": rid, "object": "chat.completion.chunk", "choices": [choice]})


def _body(request: Any, told: Transcript) -> bytes:
    found = continuable(request)
    assert found is not None
    return found.body(told, found.tokens(told))


def _data(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(event[6:-2])
    return parsed


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {}),
        (CHAT, {"n": 1, "max_tokens": 5, "tools": [], "logprobs": True}),
        (CHAT, {"response_format": {"type": "text"}}),
        (
            CHAT,
            {
                "messages": [*MESSAGES, {"role": "assistant", "content": "well"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        ),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"prompt": ["once upon"]}),
    ],
)
def test_streams_that_can_be_continued(path: str, fields: dict[str, Any]) -> None:
    assert continuable(_request(path, **fields), 7) is not None


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"stream": False}),
        (CHAT, {"n": 2}),
        (CHAT, {"response_format": {"type": "json_object"}}),
        (CHAT, {"structured_outputs": {"regex": "a+"}}),
        (CHAT, {"guided_json": {"type": "object"}}),
        (CHAT, {"echo": True}),
        (CHAT, {"prompt_logprobs": 1}),
        (CHAT, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        (CHAT, {"add_generation_prompt": False}),
        (CHAT, {"continue_final_message": True}),  # the last message is the user's
        (CHAT, {"messages": []}),
        (COMPLETIONS, {"prompt": [1, 2, 3]}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),
        (COMPLETIONS, {"suffix": "end"}),
        (COMPLETIONS, {"best_of": 3}),
    ],
)
def test_streams_that_cannot(path: str, fields: dict[str, Any]) -> None:
    assert continuable(_request(path, **fields), 7) is None


def _told(chat: bool, *pieces: bytes) -> Transcript:
    transcript = Transcript(chat)
    for piece in pieces:
        transcript.feed(piece)
    return transcript


def test_the_transcript_is_the_text_the_client_was_sent() -> None:
    events = _chunk("", role="assistant") + _chunk("Hel") + _chunk("lo, ") + _chunk("wörld")
    told = _told(True, events[:30], events[30:77], events[77:])  # pieces split anywhere
    assert (told.id, told.text, told.tokens, told.blocked) == (
        "chatcmpl-a",
        "Hello, wörld",
        3,
        None,
    )
    assert not told.finished and not told.done
    choice = {"index": 0, "text": "more", "finish_reason": None}
    completion = _told(False, _event({"id": "cmpl-b", "choices": [choice]}))
    assert (completion.id, completion.text, completion.tokens) == ("cmpl-b", "more", 1)


def test_the_transcript_knows_an_ended_answer_and_one_it_cannot_go_on_with() -> None:
    finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
    ended = _told(True, _chunk("a"), _event({"id": "x", "choices": [finish]}), b"data: [DONE]\n\n")
    assert ended.finished and ended.done
    call = [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]
    assert _told(True, _chunk("a"), _chunk(tool_calls=call)).blocked is not None
    assert _told(True, _chunk(reasoning_content="hmm")).blocked is not None
    second = {"index": 1, "delta": {"content": "b"}, "finish_reason": None}
    assert _told(True, _event({"id": "x", "choices": [second]})).blocked is not None
    assert _told(True, b"data: not json\n\n").blocked is not None


def test_a_chat_is_continued_from_the_answer_so_far() -> None:
    request = _request(CHAT, max_tokens=10, min_tokens=3, cache_salt="s", temperature=0.5)
    told = _told(True, _chunk("", role="assistant"), _chunk("one "), _chunk("two"))
    body = json.loads(_body(request, told))
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": "one two"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"]) == (8, 1)
    assert (body["cache_salt"], body["temperature"], body["stream"]) == ("s", 0.5, True)
    assert json.loads(request.body)["messages"] == MESSAGES  # the client's request untouched


def test_a_continued_final_message_and_a_completion_grow_by_the_answer() -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure: "}]
    request = _request(CHAT, messages=messages, continue_final_message=True, max_tokens=2)
    body = json.loads(_body(request, _told(True, _chunk("a"), _chunk("b"))))
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: ab"}
    assert body["max_tokens"] == 1  # never 0: vLLM refuses it
    choice = {"index": 0, "text": " a time", "finish_reason": None}
    told = _told(False, _event({"id": "c", "choices": [choice]}))
    for prompt, expected in (
        ("once upon", "once upon a time"),
        (["once upon"], ["once upon a time"]),
    ):
        body = json.loads(_body(_request(COMPLETIONS, prompt=prompt), told))
        assert body["prompt"] == expected


def test_a_continuation_is_spliced_as_the_same_answer() -> None:
    told = _told(True, _chunk("", role="assistant"), _chunk("one "), _chunk("two "))
    splice = Splice(told, told.tokens, prompt_tokens=40)
    theirs = _chunk("", rid="chatcmpl-b", role="assistant") + _chunk("three", rid="chatcmpl-b")
    usage = {
        "prompt_tokens": 44,
        "completion_tokens": 3,
        "total_tokens": 47,
        "prompt_tokens_details": {"cached_tokens": 43},
    }
    closing = _event({"id": "chatcmpl-b", "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
    out = splice.feed(theirs[:50]) + splice.feed(theirs[50:] + closing[:20])
    out += splice.feed(closing[20:]) + splice.rest()
    events = [e + b"\n\n" for e in out.split(b"\n\n") if e]
    assert len(events) == 3 and events[-1] == b"data: [DONE]\n\n"  # the role event dropped
    assert _data(events[0])["id"] == "chatcmpl-a"
    assert _data(events[0])["choices"][0]["delta"] == {"content": "three"}
    assert _data(events[1])["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 5,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 40},
    }


def test_a_splice_without_the_prompt_length_keeps_the_engines_prompt_count() -> None:
    told = _told(False, _event({"id": "c", "choices": [{"index": 0, "text": "x"}]}))
    splice = Splice(told, told.tokens, None)
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    out = splice.feed(_event({"id": "d", "choices": [], "usage": usage}))
    assert _data(out) == {
        "id": "c",
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }


def test_the_answer_so_far_is_counted_by_the_tokenizer_when_there_is_one() -> None:
    """vLLM merges events for a client that reads slowly: the tokenizer's count of the text
    so far is the budget spent, not the events; a tokenizer that fails leaves the events."""
    told = _told(True, _chunk("one two three"), _chunk(" four"))
    words = continuable(_request(CHAT, max_tokens=10), count_tokens=lambda t: len(t.split()))
    assert words is not None and words.tokens(told) == 4
    assert json.loads(words.body(told, 4))["max_tokens"] == 6

    def refuses(text: str) -> int:
        raise ValueError("a lone surrogate")

    failing = continuable(_request(CHAT), count_tokens=refuses)
    assert failing is not None and failing.tokens(told) == 2


def test_an_answer_broken_before_its_first_text_is_asked_again_as_it_was() -> None:
    request = _request(CHAT, max_tokens=10)
    assert _body(request, _told(True, _chunk("", role="assistant"))) == request.body


def test_a_long_answer_is_read_as_it_grows_and_told_whole() -> None:
    """Pieces wait unread up to a bound, then are read (a long answer never holds more than
    that in bytes); what the transcript tells is the same either way."""
    events = [_chunk(f"w{i} ") for i in range(3000)]  # about 300 KB of events
    told = _told(True, *events)
    assert told._held < 70_000  # read as it grew, not held whole
    assert told.text == "".join(f"w{i} " for i in range(3000)) and told.tokens == 3000
    blocked = _told(True, *events[:5], b"data: not json\n\n", *events[5:])
    assert blocked.blocked is not None and blocked._held == 0  # nothing more kept
