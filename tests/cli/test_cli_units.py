"""The CLI's pure parts: stream arguments, the listen view's records and text, the table."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from kvevents.cli import main
from kvevents.cli.common import UsageError
from kvevents.cli.output import stream_table
from kvevents.cli.render import ListenView, batch_summary, stats_record, text_line
from kvevents.cli.specs import stream_specs
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.subscribe import Delivery, StreamReset, StreamSpec, StreamStats, StreamStatus

SPEC = StreamSpec("a", 0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600")


def batch(*events: object, ts: float = 100.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))  # type: ignore[arg-type]


def stats(**overrides: object) -> StreamStats:
    fields: dict[str, object] = dict(
        worker_id="a",
        rank=0,
        state="live",
        received=3,
        delivered=3,
        duplicates=0,
        gaps=0,
        replays=0,
        replayed=0,
        unrecoverable=0,
        missing=0,
        restarts=0,
        decode_errors=0,
        skipped_events=0,
        events=4,
        last_seq=2,
        lag_seconds=0.5,
    )
    fields.update(overrides)
    return StreamStats(**fields)  # type: ignore[arg-type]


def test_worker_base_endpoints_expand_per_rank() -> None:
    """--worker ID=EP,REPLAY with --ranks 2 gives rank r the base ports + r."""
    specs = stream_specs([], ["a=tcp://h:5557,tcp://h:5600"], ranks=2)
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in specs] == [
        (0, "tcp://h:5557", "tcp://h:5600"),
        (1, "tcp://h:5558", "tcp://h:5601"),
    ]


def test_worker_with_rank_uses_its_own_endpoint() -> None:
    """--worker ID:RANK=EP names one rank's endpoint as given (no expansion)."""
    (spec,) = stream_specs([], ["a:3=tcp://h:40000"], ranks=4)
    assert (spec.worker_id, spec.rank, spec.endpoint, spec.replay_endpoint) == (
        "a",
        3,
        "tcp://h:40000",
        None,
    )


def test_positional_endpoints_pair_with_replays_in_order() -> None:
    """Positional endpoints become w0, w1... each with the --replay at the same position."""
    specs = stream_specs(["tcp://h:1", "tcp://g:1"], [], ["tcp://h:2", "tcp://g:2"])
    assert [(s.worker_id, s.replay_endpoint) for s in specs] == [
        ("w0", "tcp://h:2"),
        ("w1", "tcp://g:2"),
    ]


@pytest.mark.parametrize(
    ("endpoints", "workers", "replays", "message"),
    [
        ([], [], [], "no stream to read"),
        (["tcp://h:1"], [], ["tcp://h:2", "tcp://h:3"], "2 --replay endpoints for 1"),
        ([], ["a=tcp://h:1", "a=tcp://h:1"], [], "given twice"),
        ([], ["=tcp://h:1"], [], "worker id is empty"),
        ([], ["a=tcp://h:1,tcp://h:2,tcp://h:3"], [], "ENDPOINT,REPLAY_ENDPOINT"),
        ([], ["a=tcp://h:0"], [], "port 0 cannot be connected"),
    ],
)
def test_bad_stream_arguments_say_why(
    endpoints: list[str], workers: list[str], replays: list[str], message: str
) -> None:
    """Every malformed stream argument is a UsageError naming the problem."""
    with pytest.raises(UsageError, match=message):
        stream_specs(endpoints, workers, replays)


def test_batch_summary_counts_blocks_not_events() -> None:
    """A summary counts stored and removed blocks and clears."""
    stored = BlockStored(
        block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[0] * 12, block_size=4
    )
    summary = batch_summary(batch(stored, BlockRemoved(block_hashes=[9]), AllBlocksCleared()))
    assert summary == {"events": 3, "stored": 3, "removed": 1, "cleared": 1}


def test_view_calls_out_a_gap_and_its_replay() -> None:
    """A gap after seq 1 and its replay of 2..3 become 'gap' and 'replayed' records."""
    view = ListenView(clock=lambda: 100.25)
    out = []
    for item in [
        Delivery(SPEC, 0, batch()),
        Delivery(SPEC, 1, batch()),
        StreamStatus(SPEC, "replaying"),
        Delivery(SPEC, 2, batch()),
        Delivery(SPEC, 3, batch()),
        StreamStatus(SPEC, "live"),
    ]:
        out += view.records(item)
    kinds = [r["type"] for r in out]
    assert kinds == ["batch", "batch", "gap", "batch", "batch", "replayed"]
    assert out[2]["after_seq"] == 1 and out[0]["lag"] == 0.25
    assert (out[5]["first"], out[5]["last"], out[5]["batches"]) == (2, 3, 2)
    assert text_line(out[5]) == "a/0 ! replayed seq 2..3 (2 batches)"
    assert view.batches == 4


def test_view_calls_out_loss_recovery_and_restart() -> None:
    """Unrecoverable ranges, completion and restarts each get their own record and line."""
    view = ListenView()
    lost = view.records(StreamStatus(SPEC, "incomplete", (4, 9)))
    again = view.records(StreamStatus(SPEC, "live"))
    restart = view.records(StreamReset(SPEC, "restart"))
    assert lost == [{"type": "unrecoverable", "worker": "a", "rank": 0, "missing": [4, 9]}]
    assert text_line(lost[0]) == "a/0 !! seq 4..8 lost for good: view incomplete"
    assert [r["type"] for r in again + restart] == ["complete", "restart"]
    assert "publisher restarted" in text_line(restart[0])


def test_full_records_carry_tagged_events() -> None:
    """--full adds every event with its type tag."""
    (record,) = ListenView(full=True).records(Delivery(SPEC, 0, batch(AllBlocksCleared())))
    assert record["events"] == [{"type": "AllBlocksCleared"}]
    assert "CLEARED" in text_line(record)


def test_summary_lists_every_stream() -> None:
    """The summary record and its text cover each stream's losses."""
    record = stats_record({("a", 0): stats(state="incomplete", missing=5, unrecoverable=1)}, 3, 2.0)
    assert record["streams"][0]["missing"] == 5
    text = text_line(record)
    assert text.splitlines()[0] == "summary: 3 batches shown in 2.0s"
    assert "a/0: incomplete" in text and "5 lost in 1 hole," in text


def test_live_table_shows_each_stream() -> None:
    """The terminal table has a row per stream with its state, seq and lag."""
    console = Console(record=True, width=150)
    console.print(
        stream_table(
            {("a", 0): stats(), ("b", 1): stats(worker_id="b", rank=1, state="incomplete")}
        )
    )
    text = console.export_text()
    assert "a/0" in text and "b/1" in text and "incomplete" in text and "500 ms" in text


def test_usage_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A UsageError raised by a command becomes one stderr line and exit status 2."""
    assert main(["listen", "--worker", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected ID=ENDPOINT" in err


def test_version_names_the_native_accelerators(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvevents --version`` prints the version and which index tables and receive path run."""
    from kvevents import __version__
    from kvevents.index import table_implementation

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvevents {__version__} (index tables: ")
    assert ("index tables: C;" in out) == (table_implementation()[0] == "c")


def test_a_missing_extra_names_every_package_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command whose extras are missing lists all the packages in one error, exit 1."""
    import importlib.util

    real = importlib.util.find_spec
    gone = {"starlette", "uvicorn", "xxhash"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "'xxhash', 'starlette', 'uvicorn'" in err
    assert "pip install 'kvevents[service]'" in err


def test_the_pure_python_index_is_announced_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Running on the fallback tables without having asked for them prints one note."""
    import kvevents.index
    from kvevents import cli

    monkeypatch.delenv("KVEVENTS_PURE_PYTHON", raising=False)
    monkeypatch.setattr(kvevents.index, "table_implementation", lambda: ("python", "no compiler"))
    cli._warn_if_slow()
    assert capsys.readouterr().err.count("pure-Python tables (no compiler)") == 1
    monkeypatch.setattr(kvevents.index, "table_implementation", lambda: ("c", None))
    cli._warn_if_slow()
    assert capsys.readouterr().err == ""


def test_counts_agree_with_their_nouns() -> None:
    """Text output says 1 batch / 2 batches / 1 stream / 0 gaps, never "1 streams"."""
    from kvevents.cli.common import plural

    assert [plural(1, "batch"), plural(2, "batch"), plural(1, "stream"), plural(0, "gap")] == [
        "1 batch",
        "2 batches",
        "1 stream",
        "0 gaps",
    ]


def test_a_stream_without_batches_says_so() -> None:
    """The summary of a stream that delivered nothing says "no batch yet", not "last seq None"."""
    text = text_line(stats_record({("a", 0): stats(last_seq=None, delivered=0)}, 0, 1.0))
    assert "no batch yet" in text and "None" not in text


def test_full_prints_every_event_in_text_mode_too() -> None:
    """--full without --json lists each event of a batch on its own line."""
    stored = BlockStored(
        block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)), block_size=16
    )
    removed = BlockRemoved(block_hashes=[5])
    (record,) = ListenView(full=True).records(Delivery(SPEC, 0, batch(stored, removed)))
    lines = text_line(record).splitlines()
    assert len(lines) == 3
    assert "BlockStored 2 blocks" in lines[1] and "hashes=[7, 8]" in lines[1]
    assert "BlockRemoved" in lines[2] and "hashes=[5]" in lines[2]
    (brief,) = ListenView().records(Delivery(SPEC, 1, batch(stored)))
    assert len(text_line(brief).splitlines()) == 1


def test_serve_defaults_to_the_routers_default_policy() -> None:
    """``kvevents serve`` names the router's default policy without importing the index."""
    from kvevents.cli import build_parser
    from kvevents.index import DEFAULT_POLICY

    assert build_parser().parse_args(["serve"]).policy == DEFAULT_POLICY


def _demo_view() -> Any:
    from kvevents.sim import DemoView, LaneView, WorkerView

    def lane(policy: str, decided: str) -> LaneView:
        workers = (WorkerView("w0", 10, 10, 3, 40), WorkerView("w1", 8, 8, 2, 30))
        return LaneView(policy, 5, 9, 0.5, workers, 10.0, 0, 0, 0, 0, 0, decided)

    return DemoView(
        1.0,
        10.0,
        (
            lane("longest_prefix", "w1 <- most matched blocks (31)"),
            lane("round_robin", "w0 <- in turn, ignoring the cache"),
        ),
    )


def test_the_demo_shows_its_lanes_side_by_side_when_wide_and_each_latest_decision() -> None:
    """On a wide terminal both lanes' tables share lines; on a narrow one they stack; each lane
    names its latest decision and what decided it."""
    from kvevents.cli.demo import _render
    from kvevents.sim import DemoConfig

    def lines(width: int) -> list[str]:
        console = Console(width=width, record=True, color_system=None)
        console.print(_render(_demo_view(), DemoConfig()))
        return console.export_text().splitlines()

    wide = lines(200)
    assert any("longest_prefix" in ln and "round_robin" in ln for ln in wide)
    assert any("last decision: w1 <- most matched blocks (31)" in ln for ln in wide)
    narrow = lines(70)
    assert not any("longest_prefix" in ln and "round_robin" in ln for ln in narrow)
    assert any("last decision: w0 <- in turn, ignoring the cache" in ln for ln in narrow)
