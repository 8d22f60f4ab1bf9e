"""``POST /query`` with multimodal digest tokens (TensorRT-LLM's stores carry an item's hex
digest where its tokens are): the digest is part of the key over HTTP as in the library."""

from __future__ import annotations

import httpx
import pytest

from kvevents.events import BlockStored
from kvevents.http import QueryReader, serve
from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.testing.index import batch
from test_service import FakeFeed, applied

BS = 4
TEXT = list(range(100, 100 + 3 * BS))
DIGEST = "9f" * 32
MM_TOKENS: list[int | str] = [*TEXT[:BS], *[DIGEST] * BS, *TEXT[2 * BS :]]


def _store() -> BlockStored:
    return BlockStored(
        block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=MM_TOKENS, block_size=BS
    )


def test_digest_tokens_over_http_match_only_the_same_item() -> None:
    """The same digest at the same place matches all three blocks; another digest or plain
    ids only the text block before the item; an int token out of range beside a digest is
    still a 400 naming it."""
    feed = FakeFeed()
    service = IndexService(PrefixIndex(), feed=feed, poll_interval=0.01)
    with (
        serve("127.0.0.1", 0, service=service) as server,
        httpx.Client(base_url=server.url, timeout=10.0) as client,
    ):
        service.register(WorkerRegistration("t", "tcp://127.0.0.1:7100", BS))
        feed.deliver("t", 0, batch(_store()))
        applied(service, 1)

        def scores(tokens: list[int | str]) -> object:
            reply = client.post("/query", json={"token_ids": tokens})
            assert reply.status_code == 200, reply.text
            return reply.json()["scores"]

        assert scores(MM_TOKENS) == {"t": {"0": 3}}
        other = [t if t != DIGEST else "00" * 32 for t in MM_TOKENS]
        assert scores(other) == {"t": {"0": 1}}
        assert scores(list(TEXT)) == {"t": {"0": 1}}
        bad = client.post("/query", json={"token_ids": [*MM_TOKENS, 2**32]})
        assert bad.status_code == 400 and "outside 0..4294967295" in bad.json()["error"]
        long = client.post("/query", json={"token_ids": [*TEXT[:BS], "f" * 257]})
        assert long.status_code == 400 and "token_ids" in long.json()["error"]


@pytest.mark.parametrize("packers", [None, (None, None)], ids=["native", "pure-python"])
def test_the_reader_hands_digest_tokens_over_unpacked(
    packers: tuple[None, None] | None,
) -> None:
    """With or without the C packers, a body with digest tokens is read as a token list (the
    index's token-by-token path); an all-int body is still packed."""
    service = IndexService(PrefixIndex(), feed=FakeFeed())
    reader = QueryReader(service, packers)
    query, packed = reader.read(b'{"token_ids": [1, 2, "ab", 3]}')
    assert (query.token_ids, packed) == ([1, 2, "ab", 3], None)
    _, packed = reader.read(b'{"token_ids": [1, 2, 3]}')
    assert packed == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"
