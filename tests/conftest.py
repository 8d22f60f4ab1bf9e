"""Shared fixtures: see kvevents.testing for the public ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvevents.subscribe import StreamSpec, Subscriber, SubscriberOptions
from kvevents.subscribe._replay import ReplayOptions


@pytest.fixture
def subs() -> Iterator[Callable[..., Subscriber]]:
    """A factory of started subscribers, all closed after the test."""
    made: list[Subscriber] = []

    def make(specs: list[StreamSpec], **options: object) -> Subscriber:
        # A loaded CI machine can stall the replay server's thread for seconds; the default
        # 5 s idle timeout would then turn a recoverable gap into a reported loss.
        options.setdefault("replay", ReplayOptions(idle_timeout=15.0, total_timeout=60.0))
        sub = Subscriber(specs, options=SubscriberOptions(**options))  # type: ignore[arg-type]
        made.append(sub)
        sub.start()
        return sub

    yield make
    for sub in made:
        sub.close()
