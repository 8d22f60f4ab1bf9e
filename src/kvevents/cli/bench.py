"""``kvevents bench``: run the benchmark suite of a source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvevents.cli.common import UsageError

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers

EXAMPLES = """examples:
  kvevents bench                 run every benchmark and record bench/RESULTS.md
  kvevents bench wire publisher  run two of them (not recorded)
"""


def add_parser(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "bench",
        help="run the benchmarks",
        description="Run the benchmarks in bench/ (they ship with the source tree).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all, recorded)")
    parser.add_argument("--dir", type=Path, default=None, help="the bench/ directory to use")
    parser.set_defaults(run=run)


def find_bench_dir(explicit: Path | None) -> Path:
    candidates = (
        [explicit] if explicit else [Path.cwd() / "bench", Path(__file__).parents[3] / "bench"]
    )
    for candidate in candidates:
        if candidate is not None and (candidate / "run.py").is_file():
            return candidate
    raise RuntimeError("no bench/run.py found: run from a kvevents source checkout or pass --dir")


def available(bench_dir: Path) -> list[str]:
    """The benchmark names in ``bench_dir`` (``bench_NAME.py``)."""
    return sorted(p.stem[len("bench_") :] for p in bench_dir.glob("bench_*.py"))


def run(args: argparse.Namespace) -> int:
    bench_dir = find_bench_dir(args.dir)
    known = available(bench_dir)
    unknown = [name for name in args.names if name not in known]
    if unknown:
        raise UsageError(f"unknown benchmark {unknown[0]!r} (choose from {', '.join(known)})")
    # The child reports an interruption itself (what finished, nothing recorded); Ctrl-C reaches
    # both processes, so the parent only waits for the child's summary.
    child = subprocess.Popen([sys.executable, str(bench_dir / "run.py"), *args.names])
    try:
        return child.wait()
    except KeyboardInterrupt:
        return child.wait()
