"""A stand-in OpenAI-compatible engine: fast, scriptable to misbehave, recording what it got.

:class:`StandInEngine` answers like a ``vllm serve`` on its own thread and event loop:
``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` and ``/v1/completions``
(streamed as server-sent events, one HTTP chunk per event, with the ``usage`` event when
``stream_options.include_usage`` is set, or as one JSON body), on request the render endpoints
of vLLM's ``--enable-scale-out`` (``POST /v1/chat/completions/render`` and
``/v1/completions/render``: the prompt's token ids, which vLLM Router's ``cache_aware`` and
``kv_aware`` ask every worker for before routing), and any other path with a JSON echo naming
the engine. Its :class:`Behaviour` scripts the answers: a status, a delay before
the headers (``math.inf``: it never answers), a drip between pieces, huge answers, a
connection closed mid-answer, a failing ``/health``. It records each request exactly as
received (:class:`Received`: method, target, headers as spelled, body bytes) and counts the
requests whose client closed the connection before their answer ended (:attr:`aborted`).

Written on asyncio's protocol API with httptools (uvicorn's parser), so that it costs a
benchmark little: a small answer is written from the parser's callback, without a task.
Answers are deterministic (ids included), so a direct answer and a proxied one can be
compared byte for byte.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import TypeAlias, cast

import httptools
import msgspec

from kvevents.testing.sockets import wait_for

__all__ = ["Behaviour", "Received", "StandInEngine"]

_SYNC_LIMIT = 1 << 20  # answers up to this size are written at once, from the parser callback
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}
_MAX_MODEL_LEN = 4096  # what /tokenize reports, and what render's max_tokens is left from
_RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")
_VOCABULARY = 100_000  # the stand-in token ids are below this, as a real model's are

#: Writes an answer that takes time (a delay, pieces apart) on the connection.
Writer: TypeAlias = "Callable[[_Connection], Awaitable[None]]"
#: An answer: its bytes (written at once), a writer, or None to hang up answering nothing.
Answer: TypeAlias = "bytes | Writer | None"


@dataclass(frozen=True)
class Behaviour:
    """How the engine answers (swap the engine's :attr:`StandInEngine.behaviour` any time).

    ``status``: of completion answers (>= 400: an OpenAI error body). ``delay``: seconds
    before the response headers (``math.inf``: never). ``tokens``: pieces of an answer's text
    (one SSE event each when streamed); ``token_bytes``: each piece padded to this size (0:
    ``"tok<i> "``). ``token_delay``: seconds between pieces; ``torn``: each piece is written
    in two halves a moment apart (one HTTP chunk across two TCP segments). ``close_after``: close the
    connection after this many pieces; ``close_at_end``: close it after a stream's finishing
    event, before its usage and ``[DONE]``; ``hang_up``: close it as soon as a completion
    request arrives, answering nothing. ``length``: a non-streamed answer says its
    content-length (False: chunked). ``prompt_tokens``, ``cached_tokens``: the usage
    reported (``cached_tokens`` None: no ``prompt_tokens_details``, as vLLM without
    ``--enable-prompt-tokens-details``). ``health_status``, ``health_delay``: of ``/health``.
    """

    status: int = 200
    delay: float = 0.0
    tokens: int = 4
    token_bytes: int = 0
    token_delay: float = 0.0
    torn: bool = False
    close_after: int | None = None
    close_at_end: bool = False
    hang_up: bool = False
    length: bool = True
    prompt_tokens: int = 8
    cached_tokens: int | None = None
    health_status: int = 200
    health_delay: float = 0.0

    def piece(self, i: int) -> str:
        text = f"tok{i} "
        return text + "x" * (self.token_bytes - len(text)) if self.token_bytes > len(text) else text

    @property
    def quick(self) -> bool:
        """Whether an answer can be written at once from the parser's callback."""
        return (
            self.delay == 0
            and self.token_delay == 0
            and not self.torn
            and self.close_after is None
            and not self.close_at_end
            and self.tokens * max(self.token_bytes, 8) <= _SYNC_LIMIT
        )


@dataclass(frozen=True)
class Received:
    """One request as it arrived: ``target`` is the path and query as sent, ``headers`` the
    header lines in order with names as the client spelled them."""

    method: str
    target: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    at: float = field(default_factory=monotonic)

    def header(self, name: str) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), if any."""
        wanted = name.lower().encode()
        return next((v for k, v in self.headers if k.lower() == wanted), None)


@dataclass(frozen=True)
class _Completion:
    """What a completion request asks for, as the answer needs it."""

    path: str
    model: str
    stream: bool
    include_usage: bool

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"


class _Answers:
    """The bytes of answers, built from string templates (this is the benchmark's hot path)."""

    def __init__(self, completion: _Completion, behaviour: Behaviour, port: int) -> None:
        self.c = completion
        self.b = behaviour
        kind = "chat.completion" if completion.chat else "text_completion"
        # Each engine's own ids (as vLLM's differ from one answer to the next).
        rid = f"chatcmpl-stand-in-{port}" if completion.chat else f"cmpl-stand-in-{port}"
        model = _encoder.encode(completion.model).decode()
        chunk_kind = kind + ".chunk" if completion.chat else kind
        opening = '{{"id":"{}","object":"{}","created":0,"model":{},"choices":['
        self._whole_head = opening.format(rid, kind, model)
        self._event_head = opening.format(rid, chunk_kind, model)

    def _usage(self) -> str:
        b = self.b
        details = "null" if b.cached_tokens is None else f'{{"cached_tokens":{b.cached_tokens}}}'
        total = b.prompt_tokens + b.tokens
        return (
            f'"usage":{{"prompt_tokens":{b.prompt_tokens},"total_tokens":{total},'
            f'"completion_tokens":{b.tokens},"prompt_tokens_details":{details}}}'
        )

    def whole(self) -> tuple[bytes, Iterator[bytes], bytes]:
        """(prefix, pieces, suffix) of a non-streamed answer; the pieces made as they go."""
        field_ = '"message":{"role":"assistant","content":"' if self.c.chat else '"text":"'
        close = '"}' if self.c.chat else '"'
        prefix = f'{self._whole_head}{{"index":0,{field_}'.encode()
        pieces = (self.b.piece(i).encode() for i in range(self.b.tokens))
        suffix = f'{close},"logprobs":null,"finish_reason":"stop"}}],{self._usage()}}}'.encode()
        return prefix, pieces, suffix

    def whole_length(self) -> int:
        prefix, pieces, suffix = self.whole()
        return len(prefix) + sum(map(len, pieces)) + len(suffix)

    def event(self, choice: str) -> bytes:
        return f"data: {self._event_head}{choice}]}}\n\n".encode()

    def events(self) -> tuple[Iterator[bytes], list[bytes]]:
        """(the opening event and one per piece, made as they go; the events after them)."""
        chat = self.c.chat
        opening = []
        if chat:
            opening.append(self.event(_choice('"delta":{"role":"assistant","content":""}')))
        pieces = (
            self.event(_choice(_content(chat, self.b.piece(i)))) for i in range(self.b.tokens)
        )
        closing = [self.event(_choice('"delta":{}' if chat else '"text":""', '"stop"'))]
        if self.c.include_usage:
            closing.append(f"data: {self._event_head}],{self._usage()}}}\n\n".encode())
        closing.append(b"data: [DONE]\n\n")
        return itertools.chain(opening, pieces), closing


def _choice(body: str, finish: str = "null") -> str:
    return f'{{"index":0,{body},"logprobs":null,"finish_reason":{finish}}}'


def _content(chat: bool, text: str) -> str:
    return f'"delta":{{"content":"{text}"}}' if chat else f'"text":"{text}"'


def _head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))]
    lines += [f"{k}: {v}\r\n".encode() for k, v in headers]
    return b"".join([*lines, b"\r\n"])


def _json_answer(status: int, payload: bytes, extra: Sequence[tuple[str, str]] = ()) -> bytes:
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
        *extra,
    ]
    return _head(status, headers) + payload


def _text_answer(payload: bytes) -> bytes:
    headers = [("content-type", "text/plain; version=0.0.4"), ("content-length", str(len(payload)))]
    return _head(200, headers) + payload


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed by httptools and answered in order."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._queue: deque[tuple[Received, bool]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._closed_here = False  # the engine closed it (a script's close_after), not the client
        self._abort_counted = False

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one.
        self.transport = cast(asyncio.Transport, transport)
        self.engine.connections += 1
        self.engine.open_connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(_json_answer(400, b'{"error": "bad request"}', [("connection", "close")]))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.open_connections.discard(self)
        if self._task is not None and not self._task.done():
            self._count_abort()
            self._task.cancel()
        self._unblock()

    def _count_abort(self) -> None:
        """Count the request being answered as abandoned by its client (once)."""
        if not self._closed_here and not self._abort_counted:
            self._abort_counted = True
            self.engine.count_abort()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._unblock()

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        request = Received(
            method, self._url.decode("latin-1"), tuple(self._headers), b"".join(self._body)
        )
        self.engine.record(request)
        self._queue.append((request, self.parser.should_keep_alive()))
        if self._task is None or self._task.done():
            self._next()

    # ------------------------------------------------------------------ answering

    def _next(self) -> None:
        while self._queue and self.transport is not None and not self.transport.is_closing():
            request, keep_alive = self._queue.popleft()
            script = self.engine.script(request)
            if script is None:  # hang up: no answer at all
                self._close()
                return
            if isinstance(script, bytes):
                self._write(script)
                if not keep_alive:
                    self._close()
                continue
            self._task = asyncio.get_running_loop().create_task(self._run(script, keep_alive))
            return

    async def _run(self, script: Writer, keep_alive: bool) -> None:
        try:
            await script(self)
        except ConnectionError:  # found the connection closed while writing
            self._count_abort()
            return
        except asyncio.CancelledError:  # the connection was lost (counted there)
            return
        if not keep_alive:
            self._close()
        else:
            self._next()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self.engine.bytes_sent += len(data)

    async def write(self, data: bytes) -> None:
        """Write ``data`` once the transport can take it (the client reads it)."""
        while self._writable is not None and not self._writable.done():
            await self._writable
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._write(data)

    def _unblock(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _close(self) -> None:
        self._closed_here = True
        if self.transport is not None:
            self.transport.close()


class StandInEngine:
    """A stand-in engine serving ``models`` on ``host``:``port`` (0: a free port, bound now).

    :meth:`start` runs it on a thread of its own; :meth:`close` stops it. ``name`` (default:
    its URL) appears in echo answers and in its ``x-stand-in-engine`` header. ``adapters``:
    LoRA adapter -> base model, listed by ``GET /v1/models`` with their ``parent``.
    ``tokenize``: the ids ``POST /tokenize`` answers (None: it is echoed). ``render``: answer
    ``POST /v1/chat/completions/render`` and ``/v1/completions/render`` as vLLM's
    ``--enable-scale-out`` does (one ``GenerateRequest`` object; for completions a list of
    them, one per prompt), with stand-in token ids: each 4 bytes of the prompt one id (False:
    they are echoed, status 200 without ``token_ids``). ``num_gpu_blocks``:
    the KV cache its ``GET /metrics`` reports as vLLM does (``vllm:cache_config_info``; None:
    ``/metrics`` is echoed like any other path). ``keep``: how many requests :meth:`received`
    remembers. The counters (``requests``, ``aborted``,
    ``connections``, ``bytes_sent``) are read from any thread.
    """

    def __init__(
        self,
        models: Sequence[str] = ("stand-in",),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        behaviour: Behaviour | None = None,
        name: str | None = None,
        keep: int = 10_000,
        adapters: Mapping[str, str] | None = None,
        tokenize: Sequence[int] | None = None,
        render: bool = False,
        num_gpu_blocks: int | None = None,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.name = name or self.url
        self.models = tuple(models)
        self.adapters = dict(adapters or {})
        self.tokenize = None if tokenize is None else list(tokenize)
        self.render = render
        self.num_gpu_blocks = num_gpu_blocks
        self.behaviour = behaviour or Behaviour()
        self.requests = 0
        self.aborted = 0
        self.connections = 0
        self.bytes_sent = 0
        self._received: deque[Received] = deque(maxlen=keep)
        self.open_connections: set[_Connection] = set()  # touched on the engine's loop only
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> StandInEngine:
        self._thread = threading.Thread(target=self._serve, name="stand-in-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the stand-in engine on {self.url} did not start in {timeout} s")
        return self

    def _serve(self) -> None:
        loop = _new_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(
            loop.create_server(lambda: _Connection(self), sock=self._sock)
        )
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving and close every connection."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            self._sock.close()
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        future.result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for conn in list(self.open_connections):
            conn._close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    def __enter__(self) -> StandInEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ records

    def record(self, request: Received) -> None:
        with self._lock:
            self.requests += 1
            self._received.append(request)

    def count_abort(self) -> None:
        with self._lock:
            self.aborted += 1

    def received(self, path: str | None = None) -> list[Received]:
        """The requests remembered, oldest first (those to ``path`` only, when given)."""
        with self._lock:
            found = list(self._received)
        return [r for r in found if path is None or r.target.split("?")[0] == path]

    def wait_aborted(self, count: int = 1, timeout: float = 10.0) -> int:
        """Wait until ``count`` requests were abandoned by their client; returns how many."""
        return wait_for(lambda: self.aborted >= count and self.aborted, timeout, what="aborts")

    # ------------------------------------------------------------------ answers

    def script(self, request: Received) -> Answer:
        """The answer to ``request``: its bytes, a coroutine function writing it, or None
        (hang up)."""
        path = request.target.split("?")[0]
        behaviour = self.behaviour
        if request.method == "GET" and path == "/health":
            return self._health(behaviour)
        if request.method == "GET" and path == "/v1/models":
            return self._json(200, self._model_list())
        if request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            return self._completion(path, request.body, behaviour)
        if request.method == "GET" and path == "/metrics" and self.num_gpu_blocks is not None:
            return _text_answer(self._metrics_text())
        if request.method == "POST" and path == "/tokenize" and self.tokenize is not None:
            reply = {"tokens": self.tokenize, "count": len(self.tokenize), "max_model_len": 4096}
            return self._json(200, _encoder.encode(reply))
        if request.method == "POST" and path in _RENDER_PATHS and self.render:
            return self._render(path, request)
        echo = {"engine": self.name, "method": request.method, "target": request.target}
        return self._json(200, _encoder.encode({**echo, "body_bytes": len(request.body)}))

    def _render(self, path: str, request: Received) -> bytes:
        """vLLM's answer to a render request (a 400 with an OpenAI error body for a body
        vLLM would refuse). The model is not checked, as in the completion answers."""
        header = request.header("x-request-id")
        try:
            answer = _rendered(
                path, request.body, None if header is None else header.decode("latin-1")
            )
        except (msgspec.DecodeError, ValueError) as exc:
            return self._json(400, _error_body(400, f"stand-in: {exc}"))
        return self._json(200, _encoder.encode(answer))

    def _metrics_text(self) -> bytes:
        return (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            f'num_gpu_blocks="{self.num_gpu_blocks}",prefix_caching_hash_algo="sha256"}} 1.0\n'
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="stand-in"} 0.0\n'
        ).encode()

    def _json(self, status: int, payload: bytes) -> bytes:
        return _json_answer(status, payload, [("x-stand-in-engine", self.name)])

    def _model_list(self) -> bytes:
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": "stand-in", "root": m}
            for m in self.models
        ]
        cards += [  # LoRA adapters as vLLM lists them: their base model as parent
            {
                "id": a,
                "object": "model",
                "created": 0,
                "owned_by": "stand-in",
                "root": a,
                "parent": base,
            }
            for a, base in self.adapters.items()
        ]
        return _encoder.encode({"object": "list", "data": cards})

    def _health(self, behaviour: Behaviour) -> Answer:
        answer = _json_answer(behaviour.health_status, b"")
        if behaviour.health_delay == 0:
            return answer

        async def late(conn: _Connection) -> None:
            await _sleep(behaviour.health_delay)
            await conn.write(answer)

        return late

    def _completion(self, path: str, body: bytes, behaviour: Behaviour) -> Answer:
        try:
            completion = _parse_completion(path, body)
        except (msgspec.DecodeError, ValueError) as exc:
            return self._json(400, _error_body(400, f"stand-in: {exc}"))
        answers = _Answers(completion, behaviour, self.port)
        if behaviour.hang_up:
            return None
        if behaviour.status >= 400:
            failure = self._json(
                behaviour.status, _error_body(behaviour.status, "stand-in failure")
            )
            return failure if behaviour.delay == 0 else _delayed(behaviour.delay, failure)
        if behaviour.quick:
            return self._stream_bytes(answers) if completion.stream else self._whole_bytes(answers)
        return _Script(self, answers)

    def _stream_bytes(self, answers: _Answers) -> bytes:
        pieces, closing = answers.events()
        head = _head(200, self._stream_headers())
        body = b"".join(_chunk(e) for e in itertools.chain(pieces, closing))
        return head + body + b"0\r\n\r\n"

    def _whole_bytes(self, answers: _Answers) -> bytes:
        prefix, pieces, suffix = answers.whole()
        return self._json(200, prefix + b"".join(pieces) + suffix)

    def _stream_headers(self) -> list[tuple[str, str]]:
        return [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("transfer-encoding", "chunked"),
            ("x-stand-in-engine", self.name),
        ]

    def whole_headers(self, length: int | None) -> list[tuple[str, str]]:
        framing = ("content-length", str(length)) if length is not None else None
        return [
            ("content-type", "application/json"),
            framing or ("transfer-encoding", "chunked"),
            ("x-stand-in-engine", self.name),
        ]


class _Script:
    """An answer written over time: delays, drips, huge bodies, a close mid-answer."""

    def __init__(self, engine: StandInEngine, answers: _Answers) -> None:
        self.engine = engine
        self.answers = answers
        self.b = answers.b

    async def __call__(self, conn: _Connection) -> None:
        await _sleep(self.b.delay)
        if self.answers.c.stream:
            await self._stream(conn)
        else:
            await self._whole(conn)

    async def _pieces(self, conn: _Connection, pieces: Iterable[bytes], frame: bool) -> bool:
        """Write ``pieces`` (as chunks when ``frame``); False if the script closed the
        connection after ``close_after`` of them."""
        for i, piece in enumerate(pieces):
            if self.b.close_after is not None and i >= self.b.close_after:
                conn._close()
                return False
            data = _chunk(piece) if frame else piece
            if self.b.torn:
                await conn.write(data[: len(data) // 2])
                await asyncio.sleep(0.001)
                data = data[len(data) // 2 :]
            await conn.write(data)
            if self.b.token_delay:
                await _sleep(self.b.token_delay)
        return True

    async def _stream(self, conn: _Connection) -> None:
        opening_and_pieces, closing = self.answers.events()
        await conn.write(_head(200, self.engine._stream_headers()))
        if not await self._pieces(conn, opening_and_pieces, frame=True):
            return
        if self.b.close_at_end:
            await conn.write(_chunk(closing[0]))
            conn._close()
            return
        await conn.write(b"".join(_chunk(e) for e in closing) + b"0\r\n\r\n")

    async def _whole(self, conn: _Connection) -> None:
        prefix, pieces, suffix = self.answers.whole()
        chunked = not self.b.length
        length = None if chunked else self.answers.whole_length()
        head = _head(200, self.engine.whole_headers(length))
        await conn.write(head + (_chunk(prefix) if chunked else prefix))
        if await self._pieces(conn, pieces, frame=chunked):
            await conn.write(_chunk(suffix) + b"0\r\n\r\n" if chunked else suffix)


def _parse_completion(path: str, body: bytes) -> _Completion:
    document = _decoder.decode(body)
    if not isinstance(document, dict):
        raise ValueError("the body must be a JSON object")
    options = document.get("stream_options") or {}
    return _Completion(
        path=path,
        model=str(document.get("model") or "stand-in"),
        stream=bool(document.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def _stand_in_ids(text: bytes) -> list[int]:
    """Stand-in token ids of ``text``: each 4 bytes one id (those bytes as a little-endian
    number, modulo a vocabulary's size: a shared prefix gives shared ids), at least one (vLLM
    never renders none)."""
    ids = [int.from_bytes(text[i : i + 4], "little") % _VOCABULARY for i in range(0, len(text), 4)]
    return ids or [0]


def _generate_request(
    request_id: str, token_ids: list[int], document: dict[str, object], max_tokens: object
) -> dict[str, object]:
    """One of vLLM's ``GenerateRequest`` as its render endpoints answer it (every field,
    in vLLM's order; ``sampling_params`` as vLLM's defaults with the request's max_tokens,
    the rest of the request's sampling options not carried)."""
    stream = bool(document.get("stream"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = _MAX_MODEL_LEN - len(token_ids)
    sampling = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": max_tokens,
        "output_kind": 1 if stream else 2,  # vLLM's RequestOutputKind: DELTA, FINAL_ONLY
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,  # multimodal only: vLLM Router gives no cache credit with it
        "content_parts": None,
        "sampling_params": sampling,
        "model": document.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": document.get("stream_options") if stream else None,
        "cache_salt": document.get("cache_salt"),
        "priority": document.get("priority") or 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _rendered(path: str, body: bytes, header_id: str | None) -> object:
    """What vLLM's render endpoint at ``path`` answers to ``body``: for chat one
    ``GenerateRequest`` (the ids of the messages as JSON), for completions a list with one
    per prompt (a text's ids, or a token prompt's own ids). ``header_id``: the
    ``X-Request-Id`` header, which names the request as in vLLM (else the body's
    ``request_id``, else ``stand-in``). ValueError: a body vLLM refuses with a 400."""
    document = _decoder.decode(body)
    if not isinstance(document, dict):
        raise ValueError("the body must be a JSON object")
    base = header_id or str(document.get("request_id") or "stand-in")
    if path == "/v1/chat/completions/render":
        messages = document.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: a non-empty list is required")
        limit = document.get("max_completion_tokens")
        limit = document.get("max_tokens") if limit is None else limit
        ids = _stand_in_ids(_encoder.encode(messages))
        return _generate_request(f"chatcmpl-{base}", ids, document, limit)
    prompts = _prompt_ids(document.get("prompt"))
    limit = document.get("max_tokens", 16)  # vLLM's CompletionRequest default
    return [
        _generate_request(
            f"cmpl-{base}" if len(prompts) == 1 else f"cmpl-{base}-{i}", ids, document, limit
        )
        for i, ids in enumerate(prompts)
    ]


def _prompt_ids(prompt: object) -> list[list[int]]:
    """The ids of each prompt of a completion request, in vLLM's forms: a text, texts, token
    ids, lists of token ids (ValueError: none of them)."""
    if isinstance(prompt, str):
        return [_stand_in_ids(prompt.encode())]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt: a text, a list of texts or token ids is required")
    if all(isinstance(p, str) for p in prompt):
        return [_stand_in_ids(p.encode()) for p in prompt]
    if all(_token_list(p) for p in prompt):
        return [list(p) for p in prompt]
    if _token_list(prompt):
        return [list(prompt)]
    raise ValueError("prompt: a text, a list of texts or token ids is required")


def _token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    return _encoder.encode({"error": error})


def _delayed(seconds: float, answer: bytes) -> Writer:
    async def late(conn: _Connection) -> None:
        await _sleep(seconds)
        await conn.write(answer)

    return late


async def _sleep(seconds: float) -> None:
    if seconds == math.inf:
        await asyncio.get_running_loop().create_future()  # never: until the connection goes
    elif seconds > 0:
        await asyncio.sleep(seconds)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the route extra
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
