"""Endpoint parsing and per-rank layout (WIRE.md section 5)."""

from __future__ import annotations

import pytest

from kvevents import KVEventsConfig, LayoutError, check_layout, rank_endpoint, rank_endpoints
from kvevents.wire._endpoints import parse_endpoint


@pytest.mark.parametrize(
    ("base", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://0.0.0.0:5557", 1, "tcp://0.0.0.0:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://[::]:5557", 1, "tcp://[::]:5558"),
        ("tcp://engine-0.local:5557", 1, "tcp://engine-0.local:5558"),
        ("tcp://eth0:5557", 1, "tcp://eth0:5558"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
        ("inproc://kv", 12, "inproc://kv_dp12"),
        ("tcp://127.0.0.1:0", 5, "tcp://127.0.0.1:0"),
    ],
)
def test_rank_endpoint(base: str, rank: int, expected: str) -> None:
    """Rank r binds base port + r (tcp) or the _dp<r> suffix (ipc/inproc); port 0 stays ephemeral."""
    assert rank_endpoint(base, rank) == expected


def test_ipv6_host_is_flagged() -> None:
    """A bracketed host is recognised as IPv6 so the publisher can set the socket option."""
    assert parse_endpoint("tcp://[::1]:1").is_ipv6
    assert not parse_endpoint("tcp://127.0.0.1:1").is_ipv6


def test_rank_endpoints_pairs_publish_and_replay() -> None:
    """A rank's publish and replay endpoints follow the same rule."""
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557")
    got = rank_endpoints(config, 2)
    assert (got.rank, got.publish, got.replay) == (2, "tcp://*:5559", "tcp://*:6559")
    assert rank_endpoints(KVEventsConfig(), 1).replay is None


@pytest.mark.parametrize(
    ("endpoint", "rule", "text"),
    [
        ("tcp://*:x1", "port", "not numeric"),
        ("tcp://*:", "port", "not numeric"),
        ("tcp://:5557", "port", "HOST:PORT"),
        ("tcp://*:65536", "port", "out of range"),
        ("http://*:5557", "scheme", "scheme must be one of"),
        ("*:5557", "scheme", "scheme must be one of"),
        ("tcp://[::1:5557", "host", "brackets"),
        ("tcp://[zz::1]:5557", "host", "not an IPv6 address"),
        ("tcp://1.2.3.999:5557", "host", "not an IPv4 address"),
        ("tcp://bad host:5557", "host", "or a name"),
        ("inproc://", "path", "needs a path"),
    ],
)
def test_bad_endpoints_name_endpoint_and_rule(endpoint: str, rule: str, text: str) -> None:
    """Every malformed endpoint raises LayoutError carrying the endpoint and the rule."""
    with pytest.raises(LayoutError) as exc:
        parse_endpoint(endpoint)
    assert exc.value.endpoint == endpoint
    assert exc.value.rule == rule
    assert text in str(exc.value)
    assert repr(endpoint) in str(exc.value)


def test_rank_past_the_port_range_names_the_rank() -> None:
    """A rank whose port would exceed 65535 fails naming the rank."""
    with pytest.raises(LayoutError) as exc:
        rank_endpoint("tcp://*:65535", 1)
    assert (exc.value.rank, exc.value.rule) == (1, "range")
    assert "for rank 1" in str(exc.value)


def test_negative_rank_is_rejected() -> None:
    """Ranks are non-negative."""
    with pytest.raises(LayoutError) as exc:
        rank_endpoint("tcp://*:5557", -1)
    assert exc.value.rule == "rank"


def test_layout_fits_the_port_range() -> None:
    """base + world_size - 1 <= 65535, checked for the whole world at once."""
    config = KVEventsConfig(endpoint="tcp://*:65530")
    assert len(check_layout(config, world_size=6)) == 6
    with pytest.raises(LayoutError) as exc:
        check_layout(config, world_size=7)
    assert exc.value.rule == "range"
    assert exc.value.rank == 6
    assert "65530..65536" in str(exc.value)


def test_replay_range_must_fit_too() -> None:
    """The replay range obeys the same bound as the publish range."""
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:65535")
    with pytest.raises(LayoutError) as exc:
        check_layout(config, world_size=2)
    assert exc.value.endpoint == "tcp://*:65535"
    assert exc.value.rule == "range"


@pytest.mark.parametrize(
    ("replay", "world", "per_host", "ok"),
    [
        ("tcp://*:5561", 4, None, True),
        ("tcp://*:5560", 4, None, False),
        ("tcp://*:5553", 4, None, True),
        ("tcp://*:5554", 4, None, False),
        ("tcp://*:5555", 4, None, False),
        ("tcp://*:5559", 8, 2, True),
        ("tcp://*:5558", 8, 2, False),
        ("tcp://*:5558", 1, None, True),
        ("tcp://*:5557", 1, None, False),
    ],
)
def test_publish_and_replay_spacing(
    replay: str, world: int, per_host: int | None, ok: bool
) -> None:
    """Publish and replay base ports are at least ranks-per-host apart."""
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint=replay)
    if ok:
        check_layout(config, world_size=world, ranks_per_host=per_host)
        return
    with pytest.raises(LayoutError) as exc:
        check_layout(config, world_size=world, ranks_per_host=per_host)
    assert exc.value.rule == "spacing"
    assert "collide" in str(exc.value)


def test_same_ipc_path_for_publish_and_replay_is_rejected() -> None:
    """An ipc replay endpoint equal to the publish endpoint would collide."""
    config = KVEventsConfig(endpoint="ipc:///tmp/kv", replay_endpoint="ipc:///tmp/kv")
    with pytest.raises(LayoutError) as exc:
        check_layout(config)
    assert exc.value.rule == "spacing"


def test_every_rank_gets_the_same_answer() -> None:
    """The layout is a pure function: computing it on any rank yields the same list."""
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557")
    first = check_layout(config, world_size=4)
    assert all(check_layout(config, world_size=4) == first for _ in range(4))
    assert [r.publish for r in first] == [f"tcp://*:{5557 + r}" for r in range(4)]
    assert [r.replay for r in first] == [f"tcp://*:{6557 + r}" for r in range(4)]


@pytest.mark.parametrize(("world", "per_host"), [(0, None), (2, 0)])
def test_bad_world_arguments(world: int, per_host: int | None) -> None:
    """World size and ranks per host must be positive."""
    with pytest.raises(LayoutError):
        check_layout(KVEventsConfig(), world_size=world, ranks_per_host=per_host)
