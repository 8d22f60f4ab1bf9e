"""``kvevents bench``: run the benchmark suite of a source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  kvevents bench                 run every benchmark and record bench/RESULTS.md
  kvevents bench wire publisher  run two of them (not recorded)
"""


def add_parser(sub: Any) -> None:
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


def run(args: argparse.Namespace) -> int:
    bench_dir = find_bench_dir(args.dir)
    return subprocess.call([sys.executable, str(bench_dir / "run.py"), *args.names])
