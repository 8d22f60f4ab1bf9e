"""SGLang's ``--kv-events-config`` dialect: read strictly, mapped onto ``KVEventsConfig``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kvevents.config import KVEventsConfig, SGLangKVEventsConfig, read_kv_events_config

# SGLang 0.5.23's KVEventsConfig fields and defaults (sglang.srt.disaggregation.kv_events).
SGLANG_DEFAULTS = {
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "bind": None,
    "replay_endpoint": None,
    "buffer_steps": 10000,
    "hwm": 100000,
    "max_queue_size": 100000,
    "topic": "",
    "format": "default",
}


def _errors(exc: pytest.ExceptionInfo[ValidationError]) -> dict[str, str]:
    return {".".join(map(str, err["loc"])): err["msg"] for err in exc.value.errors()}


def test_fields_and_defaults_are_sglangs() -> None:
    """The dialect model has exactly SGLang's fields with SGLang's defaults."""
    assert SGLangKVEventsConfig().model_dump() == SGLANG_DEFAULTS


def test_a_full_sglang_config_maps_onto_ours() -> None:
    """Every shared field carries over; any publisher but "null" enables publishing."""
    text = json.dumps(
        {
            "publisher": "kvevents",
            "endpoint": "tcp://*:6000",
            "bind": True,
            "replay_endpoint": "tcp://*:6100",
            "buffer_steps": 50,
            "hwm": 7,
            "max_queue_size": 9,
            "topic": "kv",
            "format": "dynamo",
        }
    )
    config = read_kv_events_config(text)
    assert config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6100",
        buffer_steps=50,
        hwm=7,
        max_queue_size=9,
        topic="kv",
    )
    assert config.publishing


@pytest.mark.parametrize(("publisher", "publishing"), [("null", False), ("zmq", True)])
def test_sglang_publisher_names(publisher: str, publishing: bool) -> None:
    """SGLang's "null" publishes nothing; its "zmq" is our wire, so ours stands for it."""
    assert read_kv_events_config({"publisher": publisher}).publishing is publishing


def test_the_sglang_default_publishes_nothing() -> None:
    """SGLang's config without a publisher is its no-op publisher, as in SGLang."""
    assert not read_kv_events_config("{}").publishing


@pytest.mark.parametrize(
    "endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "ipc:///tmp/kv"]
)
def test_endpoints_sglang_binds_are_accepted_without_bind(endpoint: str) -> None:
    """A wildcard host, ipc or inproc is bound by SGLang without ``bind``, and by us."""
    assert read_kv_events_config({"publisher": "zmq", "endpoint": endpoint}).endpoint == endpoint


def test_bind_true_binds_a_concrete_host() -> None:
    """``bind: true`` on a concrete host is what kvevents does anyway."""
    config = read_kv_events_config(
        {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True}
    )
    assert config.endpoint == "tcp://127.0.0.1:5557"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"endpoint": "tcp://10.0.0.5:5557"}, "a concrete host and no bind"),
        ({"bind": False}, "bind is false"),
    ],
)
def test_connecting_configs_are_refused_naming_bind(fields: dict[str, Any], words: str) -> None:
    """Where SGLang would connect, kvevents (which only binds) refuses with the way out."""
    with pytest.raises(ValidationError) as caught:
        read_kv_events_config({"publisher": "zmq", **fields})
    errors = _errors(caught)
    assert list(errors) == ["bind"]
    assert words in errors["bind"] and "set bind to true" in errors["bind"]


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"buffer_step": 5}, "buffer_step", "Extra inputs are not permitted"),
        ({"format": "json"}, "format", "'default' or 'dynamo'"),
        ({"publisher": "nats"}, "publisher", "use one of null, zmq, kvevents"),
        ({"hwm": "100"}, "hwm", "valid integer"),
        ({"hwm": 0}, "hwm", "greater than 0"),
        ({"endpoint": "tcp://*:99999"}, "endpoint", "rule: port"),
        ({"replay_endpoint": "udp://x:1"}, "replay_endpoint", "rule: scheme"),
    ],
)
def test_bad_sglang_fields_are_named(fields: dict[str, Any], field: str, words: str) -> None:
    """Unknown fields, other formats and publishers, bad types and values name the field."""
    with pytest.raises(ValidationError) as caught:
        read_kv_events_config({"publisher": "zmq", **fields})
    errors = _errors(caught)
    assert list(errors) == [field]
    assert words in errors[field]


def test_our_dialect_keeps_its_strictness() -> None:
    """A config with enable_kv_cache_events is ours: SGLang's bind is an unknown field there."""
    with pytest.raises(ValidationError) as caught:
        read_kv_events_config({"enable_kv_cache_events": True, "bind": True})
    assert list(_errors(caught)) == ["bind"]
    with pytest.raises(ValidationError):
        KVEventsConfig.model_validate({"format": "default"})
    ours = read_kv_events_config('{"enable_kv_cache_events": true, "topic": "t"}')
    assert ours == KVEventsConfig(enable_kv_cache_events=True, topic="t")


def test_not_an_object_is_a_clear_error() -> None:
    """JSON that is not an object is refused, saying what it is."""
    with pytest.raises(ValueError, match="JSON object, not list"):
        read_kv_events_config("[1, 2]")
