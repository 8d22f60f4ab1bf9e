"""The connections to the engines (kvevents.route._client) against a scripted server: chunk
boundaries, keep-alive, backpressure, and every way an answer can fail."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvevents.route._client import EngineClient, EngineResponse, Origin, Timeouts, UpstreamError

WAIT = 5.0  # the bound on every wait in these tests
TIMES = Timeouts(connect=WAIT, first_byte=WAIT, idle=WAIT)
Script = Callable[["Scripted", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Test = Callable[["Scripted", EngineClient], Awaitable[None]]


class Scripted:
    """A server on port 0 running ``script(server, reader, writer)`` on each connection;
    ``connections``: how many were accepted, ``closed``: set when a connection's client
    closes it."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = asyncio.Event()
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
            if await reader.read(1) == b"":  # the script is done: wait for the client to go
                self.closed.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed.set()
        finally:
            writer.close()

    async def head(self, reader: asyncio.StreamReader) -> bytes:
        """One request's head and body (by its content-length), recorded."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        request = head + (await reader.readexactly(length) if length else b"")
        self.requests.append(request)
        return request

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return Origin.of(f"http://127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[Scripted]:
    server = Scripted(script)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.server.close()
        await server.server.wait_closed()


def exchange(script: Script, test: Test, **client_options: Any) -> None:
    """``test(server, client)`` against a server running ``script``, the client closed after."""

    async def main() -> None:
        async with scripted(script) as server:
            client = EngineClient(**client_options)
            try:
                await test(server, client)
            finally:
                await client.aclose()

    run(main)


def chunked(status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n" + extra + b"\r\n"
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def post(client: EngineClient, server: Scripted, body: bytes = b"{}") -> EngineResponse:
    return await client.request(
        server.origin, b"POST", b"/v1/completions", b"x-request-id: r1\r\n", body, TIMES
    )


async def read_all(response: EngineResponse) -> list[tuple[bytes, bool]]:
    out = []
    while True:
        piece, last = await asyncio.wait_for(response.read(), WAIT)
        out.append((piece, last))
        if last:
            return out


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 4 * WAIT))


def test_the_request_goes_as_given_and_chunks_come_back_whole() -> None:
    """The head has Host, the given header lines and the body's length, the body its bytes;
    an HTTP chunk that arrives in pieces comes out whole, each chunk on its own, the last
    piece marked."""
    sent = asyncio.Event()

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(chunked() + b"b\r\ndata: a")
        await writer.drain()
        await sent.wait()
        writer.write(b"bc\n\n\r\n" + chunk(b"data: d\n\n") + b"0\r\n\r\n")

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server, b'{"prompt":"\xc3\xa9"}')
        assert response.status == 200 and response.chunked
        assert response.content_type == "text/event-stream"
        sent.set()
        assert await read_all(response) == [
            (b"data: abc\n\n", False),
            (b"data: d\n\n", True),
        ]
        response.release()
        port = server.origin.port
        assert server.requests == [
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nx-request-id: r1\r\n"
            b'Content-Length: 15\r\n\r\n{"prompt":"\xc3\xa9"}' % port
        ]

    exchange(script, test)


def test_a_chunk_over_the_hold_size_comes_in_pieces_and_a_plain_body_as_it_arrives() -> None:
    taken = asyncio.Event()

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(chunked() + b"c8\r\n" + b"x" * 100)
        await writer.drain()
        await taken.wait()
        writer.write(b"y" * 100 + b"\r\n0\r\n\r\n")
        await server.head(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 6\r\n\r\n"
        )
        await writer.drain()
        writer.write(b'{"a":1')

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server)
        assert await asyncio.wait_for(response.read(), WAIT) == (b"x" * 100, False)
        taken.set()
        rest = await read_all(response)
        assert b"".join(p for p, _ in rest) == b"y" * 100 and rest[-1][1]
        response.release()
        response = await post(client, server)
        assert response.content_length == 6 and not response.chunked
        assert b"".join(p for p, _ in await read_all(response)) == b'{"a":1'
        response.release()
        assert server.connections == 1  # kept alive across the two

    exchange(script, test, hold=64)


def test_a_connection_is_reused_only_when_its_answer_ended_whole_and_was_kept_alive() -> None:
    """Read to its end: reused. ``Connection: close``, or not read to its end: closed, and
    the next request opens a new one. An idle one past the keep-alive time is not reused."""

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            request = await server.head(reader)
            close = b"close-me" in request
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
                + (b"connection: close\r\n" if close else b"")
                + b"\r\nok"
            )
            await writer.drain()
            if close:
                return

    async def test(server: Scripted, client: EngineClient) -> None:
        for _ in range(3):
            response = await post(client, server)
            await read_all(response)
            response.release()
        assert server.connections == 1 and client.idle_connections() == 1
        response = await post(client, server, b"close-me")
        await read_all(response)
        response.release()
        assert client.idle_connections() == 0
        response = await post(client, server)  # a new connection
        response.release()  # not read to its end: closed
        assert server.connections == 2 and client.idle_connections() == 0
        response = await post(client, server)
        await read_all(response)
        response.release()
        assert server.connections == 3 and client.idle_connections() == 1
        client.keepalive_timeout = 1e-9  # idle longer than that by now
        response = await post(client, server)
        await read_all(response)
        assert server.connections == 4
        response.release()

    exchange(script, test, keepalive_timeout=60)


def test_what_one_read_brought_is_taken_together() -> None:
    """read_ready takes every whole chunk read so far, each still one piece: three chunks
    written at once come together, the one written later alone, with the body's end."""
    later = asyncio.Event()

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(chunked() + chunk(b"data: a\n\n") + chunk(b"data: b\n\n") + b"9\r\ndata:")
        await writer.drain()
        await later.wait()
        writer.write(b" c\n\n\r\n" + chunk(b"data: d\n\n") + b"0\r\n\r\n")

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server)
        first = await asyncio.wait_for(response.read_ready(), WAIT)
        while first == ([b"data: a\n\n"], False):  # the head and the body in two reads
            more = await asyncio.wait_for(response.read_ready(), WAIT)
            first = ([*first[0], *more[0]], more[1])
        assert first == ([b"data: a\n\n", b"data: b\n\n"], False)
        later.set()
        rest: list[bytes] = []
        last = False
        while not last:
            pieces, last = await asyncio.wait_for(response.read_ready(), WAIT)
            rest += pieces
        assert rest == [b"data: c\n\n", b"data: d\n\n"]
        assert await response.read_ready() == ([], True)
        response.release()

    exchange(script, test)


@pytest.mark.parametrize("together", [False, True], ids=["read", "read_ready"])
def test_reading_stops_while_the_reader_does_not_take_and_resumes_when_it_does(
    together: bool,
) -> None:
    """An engine sending 16 MiB to a reader that takes nothing: the client holds at most
    about twice its hold size; then everything arrives, in order, taken a piece at a time
    or all that was read at once."""
    size = 16 << 20
    stalled = asyncio.Event()

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        block = bytes(range(256)) * 256
        sent = 0
        while sent < size:
            writer.write(block)
            sent += len(block)
            transport = writer.transport
            if transport.get_write_buffer_size() > 4 << 20:
                stalled.set()  # the client stopped reading: the socket and our buffer are full
                await writer.drain()

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server)
        await asyncio.wait_for(stalled.wait(), WAIT)
        connection = response._connection
        assert connection._buffered <= 2 * (64 << 10) + (256 << 10)
        got, last = 0, False
        while not last:
            if together:
                pieces, last = await asyncio.wait_for(response.read_ready(), WAIT)
                got += sum(map(len, pieces))
            else:
                piece, last = await asyncio.wait_for(response.read(), WAIT)
                got += len(piece)
        assert got == size
        response.release()

    exchange(script, test, hold=64 << 10)


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (b"", "reset"),  # closed before any answer
        (b"HTTP/1.1 200 OK\r\ncontent-le", "reset"),  # closed inside the headers
        (b"SPDY/9 ???\r\n\r\n", "reset"),  # not HTTP
    ],
)
def test_an_answer_that_never_comes_whole_is_a_reset(answer: bytes, kind: str) -> None:
    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def test(server: Scripted, client: EngineClient) -> None:
        with pytest.raises(UpstreamError) as raised:
            await post(client, server)
        assert raised.value.kind == kind

    exchange(script, test)


def test_no_connection_headers_late_and_silence_late_each_say_so() -> None:
    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await server.head(reader)
        if b"silent-body" in request:
            writer.write(chunked() + chunk(b"data: 1\n\n"))
            await writer.drain()
        await reader.read(1)  # silent until the client goes

    async def test(server: Scripted, client: EngineClient) -> None:
        quick = Timeouts(connect=WAIT, first_byte=0.05, idle=0.05)
        with pytest.raises(UpstreamError) as raised:
            await client.request(server.origin, b"POST", b"/", b"", b"{}", quick)
        assert raised.value.kind == "timeout"
        await asyncio.wait_for(server.closed.wait(), WAIT)  # the connection was closed
        response = await client.request(server.origin, b"POST", b"/", b"", b"silent-body", quick)
        assert await response.read() == (b"data: 1\n\n", False)
        with pytest.raises(asyncio.TimeoutError):
            await response.read()
        response.close()
        origin = server.origin
        assert server.server is not None
        server.server.close()
        await server.server.wait_closed()
        with pytest.raises(UpstreamError) as raised:
            await client.request(origin, b"GET", b"/", b"", b"", quick)
        assert raised.value.kind == "connect_error"

    exchange(script, test)


def test_a_connection_lost_mid_body_is_a_reset_and_a_cancel_closes_the_connection() -> None:
    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await server.head(reader)
        writer.write(chunked() + chunk(b"data: 1\n\n"))
        await writer.drain()
        if b"cut" in request:
            writer.close()
            return
        await reader.read(1)  # until the client goes

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server, b"cut")
        assert (await response.read())[0] == b"data: 1\n\n"
        with pytest.raises(UpstreamError) as raised:
            await asyncio.wait_for(response.read(), WAIT)
        assert raised.value.kind == "reset"
        response.close()
        server.closed.clear()
        response = await post(client, server)
        assert (await response.read())[0] == b"data: 1\n\n"
        reading = asyncio.get_running_loop().create_task(response.read())
        await asyncio.sleep(0)  # it waits for the next piece
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        response.close()  # what the proxy does with an answer it did not finish
        await asyncio.wait_for(server.closed.wait(), WAIT)

    exchange(script, test)


def test_a_body_without_length_or_chunks_ends_when_the_engine_closes() -> None:
    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await post(client, server)
        assert b"".join(p for p, _ in await read_all(response)) == b"all of it"
        response.release()
        assert client.idle_connections() == 0

    exchange(script, test)


def test_head_answers_informational_answers_and_fetch() -> None:
    """A HEAD answer ends at its headers (its connection is not reused); a 100 Continue is
    skipped for the answer after it; fetch reads a whole answer within its timeout."""

    async def script(
        server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await server.head(reader)
        if request.startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
            return
        writer.write(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 4\r\n\r\n"
        )
        await writer.drain()
        writer.write(b"done")
        await reader.read(1)

    async def test(server: Scripted, client: EngineClient) -> None:
        response = await client.request(server.origin, b"HEAD", b"/", b"", b"", TIMES)
        assert response.status == 200 and await response.read() == (b"", True)
        response.release()
        assert client.idle_connections() == 0
        port = server.origin.port
        status, body = await client.fetch(
            f"http://127.0.0.1:{port}/health", "POST", b"{}", [("a", "b")], timeout=WAIT
        )
        assert (status, body) == (201, b"done")
        assert server.requests[-1].startswith(b"POST /health HTTP/1.1\r\n")
        assert b"\r\na: b\r\n" in server.requests[-1]

    exchange(script, test)


def test_an_origin_is_read_from_its_url() -> None:
    origin = Origin.of("https://engine.example:8443/base/")
    assert (origin.host, origin.port, origin.tls) == ("engine.example", 8443, True)
    assert (origin.authority, origin.prefix) == (b"engine.example:8443", b"/base")
    assert Origin.of("http://e").port == 80
    with pytest.raises(ValueError, match="not an http"):
        Origin.of("tcp://e:1")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_an_https_engine_is_verified_and_spoken_to_over_tls(tmp_path: Path) -> None:
    """With a context that trusts the engine's certificate the answer comes over TLS; with
    the default one (the system's trust store) a self-signed engine is a connect error."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    async def test() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=served)
        port = server.sockets[0].getsockname()[1]
        try:
            client = EngineClient(tls=trusting)
            status, body = await client.fetch(f"https://localhost:{port}/health", timeout=WAIT)
            assert (status, body) == (200, b"ok")
            await client.aclose()
            default = EngineClient()
            with pytest.raises(UpstreamError) as raised:
                await default.fetch(f"https://localhost:{port}/health", timeout=WAIT)
            assert raised.value.kind == "connect_error"
            assert "CERTIFICATE_VERIFY_FAILED" in raised.value.reason
            await default.aclose()
        finally:
            server.close()
            await server.wait_closed()

    run(test)
