"""The stand-in engine's render endpoints answer as vLLM's ``--enable-scale-out`` does: status
200 and one ``GenerateRequest`` for a chat, a list of them (one per prompt) for completions,
with the fields vLLM Router reads (``token_ids``: non-empty, each a u32; ``features`` null);
a 400 with an OpenAI error body for a body vLLM refuses; off unless asked for."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvevents.testing.openai_engine import StandInEngine

Engines = Callable[..., StandInEngine]

CHAT = "/v1/chat/completions/render"
COMPLETIONS = "/v1/completions/render"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
# Every field of vLLM's GenerateRequest (vllm.entrypoints.scale_out.token_in_token_out.protocol),
# in the order its render endpoints write them.
FIELDS = [
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
]


def _post(engine: StandInEngine, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, headers=headers, timeout=10)


def _chat(*messages: dict[str, str], **fields: Any) -> dict[str, Any]:
    return {"model": "stand-in", "messages": list(messages), **fields}


def _as_vllm_router_reads(item: dict[str, Any]) -> list[int]:
    """The ids vLLM Router 0.1.17 takes from one item (it gives no cache credit otherwise)."""
    assert item["features"] is None
    ids = item["token_ids"]
    assert ids and all(isinstance(t, int) and 0 <= t < 2**32 for t in ids)
    return list(ids)


def test_a_chat_renders_as_one_generate_request(engines: Engines) -> None:
    engine = engines(render=True)
    user = {"role": "user", "content": "Say hello to the router, then count to three."}
    body = _chat(SYSTEM, user, stream=True, max_tokens=8, stream_options={"include_usage": True})
    answer = _post(engine, CHAT, body)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    item = answer.json()
    assert list(item) == FIELDS
    ids = _as_vllm_router_reads(item)
    assert len(ids) >= 16, "a chat this long fills a block of 16 (kv_aware hashes blocks)"
    assert item["request_id"] == "chatcmpl-stand-in"
    assert item["model"] == "stand-in"
    assert item["stream"] is True and item["stream_options"] == {"include_usage": True}
    assert item["sampling_params"]["max_tokens"] == 8
    assert item["output_mode"] == "tokens" and item["priority"] == 0
    assert json.loads(engine.received(CHAT)[0].body) == body


def test_render_ids_are_deterministic_and_share_a_shared_prefix(engines: Engines) -> None:
    engine = engines(render=True)
    short = _chat(SYSTEM, {"role": "user", "content": "first question"})
    longer = _chat(
        SYSTEM,
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "a second question"},
    )
    once, again, grown = (
        _post(engine, CHAT, b).json()["token_ids"] for b in (short, short, longer)
    )
    assert once == again
    assert len(grown) > len(once)
    common = len(json.dumps(SYSTEM, separators=(",", ":"))) // 4
    assert grown[:common] == once[:common]
    other = _chat({"role": "system", "content": "Something else entirely."})
    assert _post(engine, CHAT, other).json()["token_ids"][:common] != once[:common]


def test_the_request_id_comes_from_the_header_as_in_vllm(engines: Engines) -> None:
    engine = engines(render=True)
    body = _chat(SYSTEM)
    assert _post(engine, CHAT, body, **{"X-Request-Id": "r1"}).json()["request_id"] == "chatcmpl-r1"
    named = _post(engine, COMPLETIONS, {"prompt": ["a", "b"], "request_id": "r2"}).json()
    assert [item["request_id"] for item in named] == ["cmpl-r2-0", "cmpl-r2-1"]


@pytest.mark.parametrize(
    ("prompt", "count"),
    [("one text prompt", 1), (["first text", "second, longer text"], 2), ([[7, 8, 9], [10]], 2)],
)
def test_completions_render_one_generate_request_per_prompt(
    engines: Engines, prompt: Any, count: int
) -> None:
    engine = engines(render=True)
    answer = _post(engine, COMPLETIONS, {"model": "stand-in", "prompt": prompt, "max_tokens": 5})
    assert answer.status_code == 200
    items = answer.json()
    assert isinstance(items, list) and len(items) == count
    for item in items:
        assert list(item) == FIELDS
        _as_vllm_router_reads(item)
        assert item["sampling_params"]["max_tokens"] == 5
        assert item["stream"] is False and item["stream_options"] is None
    if count == 1:
        assert items[0]["request_id"] == "cmpl-stand-in"


def test_token_prompts_render_as_themselves(engines: Engines) -> None:
    engine = engines(render=True)
    answer = _post(engine, COMPLETIONS, {"model": "stand-in", "prompt": [3, 1, 4, 1, 5]}).json()
    assert [item["token_ids"] for item in answer] == [[3, 1, 4, 1, 5]]
    assert answer[0]["sampling_params"]["max_tokens"] == 16, "vLLM's completion default"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, b"{not json"),
        (CHAT, b"[1, 2]"),
        (CHAT, b'{"model": "stand-in"}'),
        (COMPLETIONS, b'{"model": "stand-in"}'),
        (COMPLETIONS, b'{"model": "stand-in", "prompt": []}'),
        (COMPLETIONS, b'{"model": "stand-in", "prompt": [1, "two"]}'),
    ],
)
def test_a_body_vllm_refuses_is_a_400(engines: Engines, path: str, body: bytes) -> None:
    engine = engines(render=True)
    answer = httpx.post(engine.url + path, content=body, timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"


def test_render_is_off_unless_asked_for(engines: Engines) -> None:
    engine = engines()
    answer = _post(engine, CHAT, _chat(SYSTEM))
    assert answer.status_code == 200
    assert "token_ids" not in answer.json(), "echoed like any other path"


@pytest.mark.vllm
def test_vllms_own_model_reads_the_answers(engines: Engines, vllm_python: str) -> None:
    """vLLM's GenerateRequest validates every answer and dumps it back with the same keys."""
    engine = engines(render=True)
    chat = _post(engine, CHAT, _chat(SYSTEM, stream=True, max_tokens=8)).json()
    completions = _post(engine, COMPLETIONS, {"model": "stand-in", "prompt": ["a", "bc"]}).json()
    script = (
        "import json, sys\n"
        "from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest\n"
        "items = json.load(sys.stdin)\n"
        "dumped = [GenerateRequest.model_validate(i).model_dump(mode='json') for i in items]\n"
        "print(json.dumps([list(GenerateRequest.model_fields), dumped]))"
    )
    done = subprocess.run(
        [vllm_python, "-c", script],
        input=json.dumps([chat, *completions]),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    fields, dumped = json.loads(done.stdout.strip().splitlines()[-1])
    assert fields == FIELDS
    for ours, theirs in zip([chat, *completions], dumped, strict=True):
        assert list(theirs) == FIELDS
        assert {k: theirs[k] for k in FIELDS if k != "sampling_params"} == {
            k: ours[k] for k in FIELDS if k != "sampling_params"
        }
        # Its dump leaves out the fields at their defaults (max_tokens: 16).
        assert (
            theirs["sampling_params"].get("max_tokens", 16) == ours["sampling_params"]["max_tokens"]
        )
