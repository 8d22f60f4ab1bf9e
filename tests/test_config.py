"""KVEventsConfig: fields, defaults, constraints, publisher resolution, JSON round trip."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvevents import KVEventsConfig

FIELDS = {
    "enable_kv_cache_events": False,
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10000,
    "hwm": 100000,
    "max_queue_size": 100000,
    "topic": "",
}


def _error_fields(exc: pytest.ExceptionInfo[ValidationError]) -> set[str]:
    return {str(err["loc"][0]) for err in exc.value.errors()}


def test_exactly_eight_fields_with_defaults() -> None:
    """The model has exactly the eight public fields, with the documented defaults."""
    assert set(KVEventsConfig.model_fields) == set(FIELDS)
    assert KVEventsConfig().model_dump() == FIELDS


def test_every_field_is_documented() -> None:
    """Each field carries a description for generated docs and --help."""
    assert all(field.description for field in KVEventsConfig.model_fields.values())


@pytest.mark.parametrize(
    ("enabled", "given", "resolved"),
    [
        (False, None, "null"),
        (True, None, "zmq"),
        (True, "null", "null"),
        (False, "zmq", "zmq"),
        (True, "zmq", "zmq"),
    ],
)
def test_publisher_resolution(enabled: bool, given: str | None, resolved: str) -> None:
    """None resolves by enable_kv_cache_events; an explicit publisher is kept as given."""
    config = KVEventsConfig(enable_kv_cache_events=enabled, publisher=given)  # type: ignore[arg-type]
    assert config.publisher == resolved
    assert config.publishing == (enabled and resolved == "zmq")


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("buffer_steps", 0, "greater than 0"),
        ("buffer_steps", -1, "greater than 0"),
        ("hwm", 0, "greater than 0"),
        ("max_queue_size", 0, "greater than 0"),
        ("endpoint", "", "at least 1 character"),
        ("replay_endpoint", "", "at least 1 character"),
        ("publisher", "kafka", "'null' or 'zmq'"),
        ("enable_kv_cache_events", "yes", "valid boolean"),
        ("buffer_steps", "10", "valid integer"),
        ("topic", 5, "valid string"),
    ],
)
def test_constraint_errors_name_the_field(field: str, value: object, rule: str) -> None:
    """Each constraint violation raises a ValidationError naming the field and the rule."""
    with pytest.raises(ValidationError) as exc:
        KVEventsConfig(**{field: value})
    assert _error_fields(exc) == {field}
    assert rule in str(exc.value)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("endpoint", "tcp://*:abc", "not numeric"),
        ("endpoint", "tcp://*", "numeric port"),
        ("endpoint", "udp://*:5557", "scheme"),
        ("endpoint", "tcp://*:70000", "out of range"),
        ("replay_endpoint", "tcp://::1:5558", "brackets"),
        ("replay_endpoint", "tcp://300.1.1.1:5558", "not an IPv4 address"),
        ("endpoint", "ipc://", "path"),
    ],
)
def test_endpoint_syntax_is_checked_at_construction(field: str, value: str, rule: str) -> None:
    """A malformed endpoint fails at construction, naming the field and the broken rule."""
    with pytest.raises(ValidationError) as exc:
        KVEventsConfig(**{field: value})
    assert _error_fields(exc) == {field}
    assert rule in str(exc.value)
    assert value in str(exc.value)


def test_unknown_fields_are_rejected() -> None:
    """A typo'd field is an error, not silently ignored."""
    with pytest.raises(ValidationError) as exc:
        KVEventsConfig(buffer_step=5)  # type: ignore[call-arg]
    assert _error_fields(exc) == {"buffer_step"}
    assert "Extra inputs are not permitted" in str(exc.value)


def test_construction_is_keyword_only() -> None:
    """Positional arguments are refused, so field order never matters to callers."""
    with pytest.raises(TypeError):
        KVEventsConfig(True)  # type: ignore[misc]


def test_frozen() -> None:
    """A config cannot be mutated after validation (it would bypass the checks)."""
    config = KVEventsConfig()
    with pytest.raises(ValidationError):
        config.hwm = 0  # type: ignore[misc]


def test_accepts_command_line_json() -> None:
    """The JSON string users pass to engines on the command line validates directly."""
    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    config = KVEventsConfig.model_validate_json(text)
    assert config.publisher == "zmq"
    assert config.endpoint == "tcp://*:6000"
    assert config.topic == "kv"


def test_json_round_trip_preserves_meaning() -> None:
    """Dumping to JSON and reading back gives an equal config, for every field set."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://[::1]:7000",
        replay_endpoint="tcp://127.0.0.1:7100",
        buffer_steps=3,
        hwm=7,
        max_queue_size=9,
        topic="t",
    )
    again = KVEventsConfig.model_validate_json(config.model_dump_json())
    assert again == config
    assert json.loads(config.model_dump_json())["publisher"] == "zmq"


def test_json_errors_name_the_field() -> None:
    """Bad JSON values report the field just like keyword construction."""
    with pytest.raises(ValidationError) as exc:
        KVEventsConfig.model_validate_json('{"hwm": 0}')
    assert _error_fields(exc) == {"hwm"}
