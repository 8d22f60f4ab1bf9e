"""Argument types and process helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    # What ArgumentParser.add_subparsers() returns: typeshed names its class only privately.
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = [
    "UsageError",
    "non_negative_int",
    "plural",
    "positive_float",
    "positive_int",
    "stop_on_sigterm",
]


class UsageError(ValueError):
    """A bad command line found after parsing: reported in one line with exit status 2."""


def plural(count: int, noun: str) -> str:
    """``1 batch``, ``2 batches``, ``0 streams``: a count with its noun agreed."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{count} {noun}s"


def _number(text: str, kind: type[int] | type[float], low: float, what: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low or value != value:  # NaN compares unequal to itself
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return int(_number(text, int, 1, "an integer >= 1"))


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return int(_number(text, int, 0, "an integer >= 0"))


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(_number(text, float, 0, "a number > 0"))
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while the block runs, so commands stop cleanly and summarize."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
