"""The Mooncake trace loader: the real synthetic trace, deterministic blocks, shared prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvevents.errors import TraceError
from kvevents.sim._hashing import engine_chain_hashes
from kvevents.sim._trace import (
    TRACE_BLOCK_SIZE,
    TraceRow,
    block_tokens,
    default_trace_path,
    load_trace,
    row_tokens,
)

TRACE = Path(default_trace_path())


def test_synthetic_trace_loads_every_row() -> None:
    """All 3,993 rows load, in timestamp order, and each prompt has input_length tokens."""
    rows = load_trace(TRACE)
    assert len(rows) == 3993
    assert [r.timestamp for r in rows] == sorted(r.timestamp for r in rows)
    assert all(len(row_tokens(r)) == r.input_length for r in rows[:50])


def test_rows_sharing_ids_share_tokens_and_engine_hashes() -> None:
    """Two rows with a common leading id run share those tokens and the engine's hashes."""
    rows = load_trace(TRACE, limit=400)
    first_seen: dict[int, TraceRow] = {}
    pair = None
    for row in rows:
        other = first_seen.get(row.hash_ids[0])
        if other is not None and other.hash_ids[:2] == row.hash_ids[:2] and other != row:
            pair = (other, row)
            break
        first_seen.setdefault(row.hash_ids[0], row)
    assert pair is not None
    a, b = (row_tokens(r)[: 2 * TRACE_BLOCK_SIZE] for r in pair)
    assert a == b
    assert engine_chain_hashes(a, 16) == engine_chain_hashes(b, 16)


def test_block_tokens_are_deterministic_and_distinct() -> None:
    """An id maps to the same 512 tokens every time (pinned), and ids differ from each other."""
    tokens = block_tokens(0)
    assert len(tokens) == 512 and all(0 <= t < 65536 for t in tokens)
    assert tokens == block_tokens(0)
    assert tokens[:4] == [33521, 52463, 34418, 54469]  # pinned: same on every machine
    assert block_tokens(1) != tokens


def test_partial_last_block_is_cut_to_input_length() -> None:
    """The last block contributes only what input_length leaves of it."""
    row = TraceRow(timestamp=0, input_length=600, output_length=1, hash_ids=[7, 8])
    tokens = row_tokens(row)
    assert tokens == block_tokens(7) + block_tokens(8)[:88]


def test_malformed_row_names_file_and_line(tmp_path: Path) -> None:
    """A bad row raises TraceError naming the path and the 1-based line."""
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(
        good
        + "\n\n"
        + '{"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [1]}\n'
    )
    with pytest.raises(
        TraceError, match=r"t.jsonl:3: input_length 900 does not fit 1 hash ids"
    ) as err:
        load_trace(path)
    assert err.value.line == 3
    path.write_text('{"timestamp": "x"}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: "):
        load_trace(path)


def test_limit_reads_only_the_first_rows(tmp_path: Path) -> None:
    """limit stops reading early, so a bad row after the limit is never reached."""
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(good + "\n" + good + "\nnot json\n")
    assert len(load_trace(path, limit=2)) == 2


def test_the_default_trace_ships_inside_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without KVEVENTS_TRACE the default is the bundled gzip trace inside the installed package,
    and it reads the same rows as its uncompressed form."""
    import gzip

    import kvevents

    monkeypatch.delenv("KVEVENTS_TRACE", raising=False)
    path = Path(default_trace_path())
    assert path.is_relative_to(Path(kvevents.__file__).parent)
    assert path.suffix == ".gz"
    assert (path.parent / "README.md").read_text().count("Apache") >= 1
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    assert load_trace(plain, limit=20) == load_trace(path, limit=20)
