"""Where command records go: JSON lines, plain text lines, or a rich live view on a terminal."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

import msgspec

from kvevents.cli.render import Record, text_line
from kvevents.events import StreamKey
from kvevents.subscribe import StreamStats

__all__ = ["JsonOutput", "LiveOutput", "Output", "TextOutput", "stream_table"]

StatsSource = Callable[[], Mapping[StreamKey, StreamStats]]


class Output(Protocol):
    def emit(self, record: Record) -> None: ...
    def refresh(self) -> None: ...
    def close(self) -> None: ...


class JsonOutput:
    """One JSON object per line, flushed at once so a pipe sees each record as it happens."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout

    def emit(self, record: Record) -> None:
        self.stream.write(msgspec.json.encode(record).decode() + "\n")
        self.stream.flush()

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class TextOutput(JsonOutput):
    """One readable line per record."""

    def emit(self, record: Record) -> None:
        self.stream.write(text_line(record) + "\n")
        self.stream.flush()


_COLUMNS = (
    "stream",
    "state",
    "last seq",
    "delivered",
    "replayed",
    "events",
    "gaps",
    "lost",
    "restarts",
    "lag",
)


def _lag(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


# A rich Table: rich is imported lazily, only when drawing.
def stream_table(stats: Mapping[StreamKey, StreamStats]) -> Any:
    """A rich table with one row per stream; incomplete streams stand out."""
    from rich.table import Table

    table = Table(expand=True)
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("stream", "state") else "right")
    for (worker, rank), s in sorted(stats.items()):
        style = {"incomplete": "bold red", "replaying": "yellow"}.get(s.state, "")
        table.add_row(
            f"{worker}/{rank}",
            s.state,
            str(s.last_seq if s.last_seq is not None else "-"),
            str(s.delivered),
            str(s.replayed),
            str(s.events),
            str(s.gaps),
            str(s.missing),
            str(s.restarts),
            _lag(s.lag_seconds),
            style=style,
        )
    return table


class LiveOutput:
    """A terminal view redrawn a few times a second: the streams table and recent lines."""

    def __init__(self, stats: StatsSource, *, recent: int = 12) -> None:
        from rich.console import Console
        from rich.live import Live

        self.stats = stats
        self.lines: collections.deque[str] = collections.deque(maxlen=recent)
        self.notes: collections.deque[str] = collections.deque(maxlen=recent // 2)
        self.final: list[str] = []
        self.console = Console()
        self.live = Live(self._render(), console=self.console, refresh_per_second=4)
        self.live.start()

    def _render(self) -> Any:  # a rich renderable: rich is imported lazily, only when drawing
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text

        return Group(
            stream_table(self.stats()),
            Panel(Text("\n".join(self.notes) or "no gaps, replays or restarts"), title="call-outs"),
            Panel(Text("\n".join(self.lines)), title="latest batches"),
        )

    def emit(self, record: Record) -> None:
        if record["type"] == "summary":
            self.final.append(text_line(record))
        elif record["type"] == "batch":
            self.lines.append(text_line(record))
        else:
            self.notes.append(text_line(record))

    def refresh(self) -> None:
        self.live.update(self._render())

    def close(self) -> None:
        self.live.update(self._render())
        self.live.stop()
        for line in self.final:
            self.console.print(line, highlight=False)
