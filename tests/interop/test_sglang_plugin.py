"""The SGLang plugin's publisher (kvevents.integrations.sglang) on its own, without SGLang:
what SGLang's factory passes it, what its scheduler asks of it, and its shutdown."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from pydantic import ValidationError

from kvevents.errors import PublisherClosed
from kvevents.integrations.sglang import SGLangPublisher, register

# What SGLang 0.5.23's EventPublisherFactory passes: its config's fields minus publisher and
# format (the factory pops both), as keywords, after attn_dp_rank.
FACTORY_FIELDS = {
    "endpoint": "tcp://127.0.0.1:0",
    "bind": True,
    "replay_endpoint": None,
    "buffer_steps": 10,
    "hwm": 100,
    "max_queue_size": 10,
    "topic": "t",
}


def test_built_from_the_factorys_keywords_and_described_as_sglang_asks() -> None:
    """SGLang's keywords build it; describe_local_source names the bound port on loopback."""
    publisher = SGLangPublisher(attn_dp_rank=2, **FACTORY_FIELDS)
    try:
        source = publisher.describe_local_source(16)
    finally:
        publisher.shutdown()
    assert source is not None
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and not source["endpoint"].endswith(
        ":0"
    )
    assert {k: source[k] for k in ("dp_rank", "topic", "block_size")} == {
        "dp_rank": 2,
        "topic": "t",
        "block_size": 16,
    }
    assert "replay_endpoint" not in source


def test_a_wildcard_bind_is_described_on_loopback(tmp_path: Path) -> None:
    """A wildcard bind is reachable on loopback; an ipc path is given as bound."""
    fields = {**FACTORY_FIELDS, "endpoint": "tcp://*:0", "replay_endpoint": f"ipc://{tmp_path}/r"}
    publisher = SGLangPublisher(attn_dp_rank=0, **fields)
    try:
        source = publisher.describe_local_source(4)
    finally:
        publisher.shutdown()
    assert source is not None and source["endpoint"].startswith("tcp://127.0.0.1:")
    assert source["replay_endpoint"] == f"ipc://{tmp_path}/r"


def test_an_inproc_publisher_has_no_local_source() -> None:
    """inproc is reachable from this process only: nothing to describe (as SGLang's own)."""
    publisher = SGLangPublisher(attn_dp_rank=0, **{**FACTORY_FIELDS, "endpoint": "inproc://sg"})
    try:
        assert publisher.describe_local_source(4) is None
    finally:
        publisher.shutdown()


def test_unknown_factory_keywords_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A keyword SGLang's config does not have yet (a newer SGLang's) is named in a warning and
    ignored: SGLang validated its config already, so refusing would only stop the engine."""
    with caplog.at_level("WARNING", logger="kvevents.integrations.sglang"):
        publisher = SGLangPublisher(attn_dp_rank=0, compression="zstd", **FACTORY_FIELDS)
    try:
        assert publisher.describe_local_source(4) is not None
    finally:
        publisher.shutdown()
    assert "compression" in caplog.text


def test_a_bad_value_of_a_known_field_is_still_refused_by_name() -> None:
    """Known fields keep their rules: a negative buffer_steps is a ValidationError naming it."""
    with pytest.raises(ValidationError, match="buffer_steps"):
        SGLangPublisher(attn_dp_rank=0, **{**FACTORY_FIELDS, "buffer_steps": -1})


def test_unreadable_batches_are_counted_and_shutdown_is_idempotent() -> None:
    """A batch that is not one is skipped and counted; shutdown twice is harmless, publish after
    it raises PublisherClosed."""
    publisher = SGLangPublisher(attn_dp_rank=0, **FACTORY_FIELDS)
    publisher.publish(msgspec.Raw(msgspec.msgpack.encode([0.0, [], None])))
    publisher.publish(msgspec.Raw(msgspec.msgpack.encode("not a batch")))
    publisher.shutdown()
    publisher.shutdown()
    stats = publisher.stats()
    assert (stats.batches_skipped, stats.events_skipped, stats.publisher.next_seq) == (1, 0, 1)
    with pytest.raises(PublisherClosed):
        publisher.publish(msgspec.Raw(msgspec.msgpack.encode([0.0, [], None])))


def test_register_outside_sglang_does_nothing() -> None:
    """Without SGLang installed the entry point returns quietly (it may be loaded anywhere)."""
    assert register() is None
