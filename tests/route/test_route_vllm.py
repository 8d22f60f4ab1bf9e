"""``kvevents route`` in front of two real vLLM CPU engines, driven by the ``openai`` client.

The engines serve the tiny chat model (a real BPE tokenizer and chat template), publish KV
events with replay, and report ``usage.prompt_tokens_details.cached_tokens``: the ground
truth every prediction of the front door is held to. One module-scoped pair of engines; the
tests run in order and each leaves the engines serving.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvevents.deadline import Deadline
from kvevents.route._frontdoor import EngineSpec, FrontDoor
from kvevents.route._plan import PlannerOptions
from kvevents.route._tokens import ModelTokenizer
from kvevents.subscribe import Delivery, Subscriber, worker_streams
from kvevents.testing.vllm_server import VllmServer, start_servers

# Two engines start in about a minute on two idle cores; much longer on a busy machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
# Room for the abort test's long answers (12 x 3,500 tokens at once: seconds on these engines,
# which generate thousands of tokens a second); 4 KB of KV cache a token.
BLOCKS = 1400
CONTEXT = 4096
SYNC_TIMEOUT = 20.0
SETTLE = 0.3  # seconds with no new batch from an engine: it has published what it had


@dataclass
class Rig:
    """The engines, the front door in front of them, and a subscriber of our own that tells
    when the engines' events have reached the front door."""

    servers: list[VllmServer]
    door: FrontDoor
    client: openai.OpenAI
    watcher: Subscriber
    seen: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    checked: list[tuple[int, int]] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.servers[0].model

    def watch(self) -> None:
        for item in self.watcher:
            if isinstance(item, Delivery):
                with self.lock:
                    self.seen[item.stream.worker_id] = item.seq

    def sync(self) -> None:
        """Wait until the engines are quiet and the front door has applied all they sent."""
        deadline = Deadline(SYNC_TIMEOUT)
        before = None
        while True:
            with self.lock:
                now = dict(self.seen)
            if now == before:
                break
            before = now
            time.sleep(SETTLE)
            assert not deadline.expired, "the engines kept publishing"
        assert self.door.service is not None
        while True:
            stats = self.door.service.stream_health()
            if not self.door.service.degraded() and all(  # degraded: still replaying
                (stats.get((w, 0)) is not None and stats[(w, 0)].last_seq == seq)
                for w, seq in now.items()
            ):
                return
            assert not deadline.expired, f"the front door lags: {stats} vs {now}"
            time.sleep(0.01)

    def record(self, predicted: str | None, usage: Any) -> int:
        """Hold one answer's prediction to the engine's reported cached tokens."""
        assert predicted is not None, "no x-kvevents-predicted-cached-tokens header"
        cached = usage.prompt_tokens_details.cached_tokens
        self.checked.append((int(predicted), cached))
        assert int(predicted) == cached, f"predicted {predicted}, engine cached {cached}"
        return int(cached)


@pytest.fixture(scope="module")
def rig(
    vllm_python: str, vllm_chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = start_servers(
        VllmServer(
            vllm_python,
            vllm_chat_model,
            block_size=BLOCK,
            num_blocks=BLOCKS,
            max_model_len=CONTEXT,
            log_dir=logs,
        )
        for _ in range(2)
    )
    try:
        specs = [
            EngineSpec(s.url, f"e{i}", s.event_endpoint(), s.replay_endpoint(), block_size=BLOCK)
            for i, s in enumerate(servers)
        ]
        tokenizer = ModelTokenizer.load(vllm_chat_model, model_name=servers[0].model)
        door = FrontDoor(
            specs,
            {None: tokenizer},
            planner_options=PlannerOptions(block_size=BLOCK),
            health_interval=0.5,
        ).start()
        streams = [
            spec
            for i, s in enumerate(servers)
            for spec in worker_streams(f"e{i}", s.event_endpoint(), s.replay_endpoint())
        ]
        watcher = Subscriber(streams)
        watcher.start()
        client = openai.OpenAI(base_url=f"{door.url}/v1", api_key="none", max_retries=0)
        rig = Rig(servers, door, client, watcher)
        threading.Thread(target=rig.watch, daemon=True).start()
        yield rig
        watcher.close()
        client.close()
        door.close()
    finally:
        for server in servers:
            server.close()


SYSTEM = "You are a terse assistant for the kvevents test suite. " * 12


def chat(
    rig: Rig, messages: list[dict[str, str]], *, stream: bool = False, **extra: Any
) -> tuple[str, str]:
    """(engine, reply text) of one chat request; its prediction checked."""
    rig.sync()
    if stream:
        raw = rig.client.chat.completions.with_raw_response.create(
            model=rig.model,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra or None,
        )
        text, usage = "", None
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    else:
        raw = rig.client.chat.completions.with_raw_response.create(
            model=rig.model, messages=messages, max_tokens=8, extra_body=extra or None
        )
        reply = raw.parse()
        text, usage = reply.choices[0].message.content or "", reply.usage
    rig.record(raw.headers.get("x-kvevents-predicted-cached-tokens"), usage)
    return raw.headers["x-kvevents-engine"], text


def test_a_conversations_later_turns_land_where_its_history_is_and_every_prediction_holds(
    rig: Rig,
) -> None:
    """Three conversations of four turns, streamed and not: from the second turn on, each goes
    to the engine that holds its history, and every predicted cached token count equals what
    the engine reported."""
    for n in range(3):
        messages = [{"role": "system", "content": SYSTEM + f" Conversation {n}."}]
        engines = []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Turn {turn} of talk {n}: say something."})
            engine, text = chat(rig, messages, stream=turn % 2 == 1)
            messages.append({"role": "assistant", "content": text})
            engines.append(engine)
        assert len(set(engines[1:])) == 1, engines
    assert any(cached > 0 for _, cached in rig.checked)


def test_completions_streamed_and_not_are_predicted_exactly(rig: Rig) -> None:
    """Completion prompts as text and as token ids, streamed and not: predictions hold."""
    prompt = "Once upon a time in the land of kvevents " * 20
    for stream in (False, True, False):
        rig.sync()
        if stream:
            raw = rig.client.completions.with_raw_response.create(
                model=rig.model,
                prompt=prompt,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [c.usage for c in raw.parse() if c.usage is not None][-1]
        else:
            raw = rig.client.completions.with_raw_response.create(
                model=rig.model, prompt=prompt, max_tokens=4
            )
            usage = raw.parse().usage
        rig.record(raw.headers.get("x-kvevents-predicted-cached-tokens"), usage)
    assert rig.checked[-1][1] > 0  # the prompt was cached by then


def test_a_salted_request_gets_no_credit_from_unsalted_blocks(rig: Rig) -> None:
    """The same prompt with a cache_salt is a miss (predicted 0, and the engine agrees); the
    same salt again hits."""
    messages = [
        {"role": "system", "content": SYSTEM + " Salted."},
        {"role": "user", "content": "hi"},
    ]
    chat(rig, messages)
    chat(rig, messages)
    assert rig.checked[-1][1] > 0
    chat(rig, messages, cache_salt="tenant-a")
    assert rig.checked[-1] == (0, 0)
    chat(rig, messages, cache_salt="tenant-a")
    assert rig.checked[-1][1] > 0


def _engine_totals(rig: Rig) -> tuple[float, float, float]:
    """(requests running, tokens generated, requests finished) over the engines."""
    running = generated = finished = 0.0
    for server in rig.servers:
        metrics = server.metrics()
        running += metrics.get("vllm:num_requests_running", 0.0)
        generated += metrics.get("vllm:generation_tokens_total", 0.0)
        finished += metrics.get("vllm:request_success_total", 0.0)
    return running, generated, finished


def _wait_running(rig: Rig, want: float, *, at_least: bool = False) -> None:
    """Until the engines run ``want`` requests (``at_least``: ``want`` or more)."""
    deadline = Deadline(20)
    while not _running_is(_engine_totals(rig)[0], want, at_least):
        assert not deadline.expired, f"the engines never had {want:g} requests running"
        time.sleep(0.05)


def _running_is(running: float, want: float, at_least: bool) -> bool:
    return running >= want if at_least else running == want


LONG = 3500  # tokens each of a request's answers asks for
# Answers of a request: together many seconds of work for an engine, so that a hang-up is
# seen long before they are done even when the engine's server is slow to hear of it (with 6,
# a loaded CI machine once saw all of them finish first: its /health took over 1 s then).
CHOICES = 12


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_request_on_the_engine(rig: Rig, stream: bool) -> None:
    """A request (streamed or not) whose client closes its connection mid-answer is aborted on
    the engine: it never finishes (vLLM 0.32 counts no finished_reason for an abort), and it
    stops running long before its tokens are generated, counted from the hang-up (not from
    the request's start: how soon a loaded machine sees it running is not the front door's)."""
    _wait_running(rig, 0)
    finished = _engine_totals(rig)[2]
    body = {
        "model": rig.model,
        "prompt": "count forever",
        "max_tokens": LONG,
        "n": CHOICES,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        with httpx.Client(timeout=30) as http:
            request = http.build_request("POST", f"{rig.door.url}/v1/completions", json=body)
            response = http.send(request, stream=True)
            assert response.status_code == 200
            next(response.iter_bytes())
            at_hang_up = _engine_totals(rig)[1]
            response.close()
    else:  # no byte comes before the end: send it raw, wait until it runs, hang up
        payload = json.dumps(body).encode()
        host, port = rig.door.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            # Running at all is enough: the engine may schedule a request's answers a few at
            # a time (a full step, its KV cache), so all CHOICES at once is not guaranteed.
            _wait_running(rig, 1, at_least=True)
            at_hang_up = _engine_totals(rig)[1]
    _wait_running(rig, 0)
    _, generated, finished_now = _engine_totals(rig)
    assert finished_now == finished, "the request ran to its end: it was not aborted"
    assert generated - at_hang_up < LONG * CHOICES / 2


def _stream_killed_as_it_begins(rig: Rig) -> tuple[str | None, list[Any]]:
    """A long stream whose engine is killed as soon as its answer's head and first piece are
    at the client, if the engine is still generating it then: (the engine's name, or None
    when it had generated the whole answer already, which a loaded machine's slow client lets
    happen: the answer is then in the sockets' buffers and nothing is left to continue;
    every chunk the client read)."""
    generated = [s.metrics().get("vllm:generation_tokens_total", 0.0) for s in rig.servers]
    raw = rig.client.chat.completions.with_raw_response.create(
        model=rig.model,
        messages=[{"role": "user", "content": "tell a long story"}],
        max_tokens=LONG,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    name = raw.headers["x-kvevents-engine"]
    index = int(name[1:])
    victim = rig.servers[index]
    done = victim.metrics().get("vllm:generation_tokens_total", 0.0) - generated[index]
    killed = done < LONG - 100
    if killed:
        victim.kill()
    return (name if killed else None), list(raw.parse())


def test_an_engine_killed_mid_run_costs_the_clients_no_error(rig: Rig) -> None:
    """The engine running a stream is killed as its answer begins: the stream goes on from the
    other engine to its full length, as one answer (one id, its usage the whole answer's), and
    every later request gets a 200 from the survivor; the dead one's cache credit goes; once it
    is back, it takes requests again."""
    rig.sync()
    continued = rig.door.app.stats().counts.continued
    for _ in range(3):
        name, chunks = _stream_killed_as_it_begins(rig)
        if name is not None:
            break
    else:
        pytest.fail("three times the engine had generated the whole answer before its first")
    victim = rig.servers[int(name[1:])]
    survivor = f"e{1 - int(name[1:])}"
    assert rig.door.app.stats().counts.continued == continued + 1, "the stream was not continued"
    assert len({c.id for c in chunks}) == 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and finish.count("length") == 1
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == LONG
    statuses = []
    for i in range(6):
        raw = rig.client.chat.completions.with_raw_response.create(
            model=rig.model,
            messages=[{"role": "user", "content": f"after the crash {i}"}],
            max_tokens=4,
        )
        statuses.append(raw.status_code)
        assert raw.headers["x-kvevents-engine"] == survivor
    assert statuses == [200] * 6
    victim.launch(same_ports=True).wait_ready()
    deadline = Deadline(30)
    while not all(e.up for e in rig.door.pool.engines):
        assert not deadline.expired, "the restarted engine was not put back"
        time.sleep(0.2)
