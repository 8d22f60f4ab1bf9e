"""Fixtures of the front door's tests: stand-in engines, and proxies in front of them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvevents.testing.openai_engine import StandInEngine
from kvevents.testing.route import RunningProxy, running_proxy


@pytest.fixture
def engines() -> Iterator[Callable[..., StandInEngine]]:
    """A factory of started stand-in engines, all closed after the test."""
    made: list[StandInEngine] = []

    def make(*models: str, **options: Any) -> StandInEngine:
        engine = StandInEngine(models or ("stand-in",), **options)
        made.append(engine)
        return engine.start()

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def proxy() -> Iterator[Callable[..., RunningProxy]]:
    """A factory of started front doors (``running_proxy`` arguments), stopped after the test."""
    with contextlib.ExitStack() as stack:

        def make(*engines: StandInEngine | str, **options: Any) -> RunningProxy:
            urls = [e if isinstance(e, str) else e.url for e in engines]
            return stack.enter_context(running_proxy(urls, **options))

        yield make
