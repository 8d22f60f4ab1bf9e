"""Run every bench/bench_*.py module, print the figures and record them in bench/RESULTS.md.

Each module defines ``run() -> list[Row]``. ``python bench/run.py [name ...]`` runs a subset
and records nothing; ``python bench/run.py --record name ...`` runs a subset and puts its
sections into bench/RESULTS.md in place of the same sections of an earlier run (the others
kept; bench/RESULTS.svg, the chart of every section, is left as it was). A module may define
``record(rows, bench_dir)`` too: called whenever its rows are recorded, it writes files of its
own (``bench_route``: its chart and the benchmark client's reports).
``bench_vllm`` runs a real vLLM engine where ``.venv-vllm`` has one (``make vllm``, about two
minutes); elsewhere it prints why it is skipped and records nothing.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import Row  # noqa: E402


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import msgspec
    import zmq

    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
        f"msgspec {msgspec.__version__}"
    )


def fmt(value: float | None) -> str:
    if value is None:
        return ""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def render(rows: list[Row], header: str) -> str:
    out = [header, ""]
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            out += ["", f"### {section}", ""]
            out.append("| case | metric | value | baseline | ratio | target |")
            out.append("|---|---|---|---|---|---|")
        base = f"{fmt(row.baseline)} ({row.baseline_name})" if row.baseline is not None else ""
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        out.append(
            f"| {row.case} | {row.metric} | {fmt(row.value)} {row.unit} | {base} | {ratio} | {row.target} |"
        )
    return "\n".join(out) + "\n"


def merge(existing: str, rows: list[Row], note: str) -> str:
    """``existing`` RESULTS.md with the sections of ``rows`` replaced (or appended), each with
    ``note`` under its heading."""
    blocks: dict[str, str] = {}
    head, *parts = existing.split("\n### ")
    for part in parts:
        heading = part.split("\n", 1)[0]
        blocks[heading] = "### " + part.rstrip("\n") + "\n"
    fresh = render(rows, "").split("\n### ")[1:]
    for part in fresh:
        heading, _, rest = part.partition("\n")
        blocks[heading] = f"### {heading}\n\n{note}\n{rest.rstrip(chr(10))}\n"
    return head.rstrip("\n") + "\n\n\n" + "\n".join(blocks.values())


def record_hooks(names: list[str], rows_by_name: dict[str, list[Row]]) -> None:
    for name in names:
        hook = getattr(importlib.import_module(f"bench_{name}"), "record", None)
        if hook is not None:
            for path in hook(rows_by_name[name], HERE):
                print(f"recorded {path}")


def main(argv: list[str]) -> int:
    partial = "--record" in argv
    argv = [a for a in argv if a != "--record"]
    names = argv or sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py"))
    known = sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py"))
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"unknown benchmark {unknown[0]!r} (choose from {', '.join(known)})", file=sys.stderr)
        return 2
    rows: list[Row] = []
    done: list[str] = []
    by_name: dict[str, list[Row]] = {}
    try:
        for name in names:
            current = name
            print(f"== bench_{name}", flush=True)
            got = by_name[name] = importlib.import_module(f"bench_{name}").run()
            rows += got
            done.append(name)
            print(render(got, ""), flush=True)
    except KeyboardInterrupt:
        finished = ", ".join(done) or "none"
        print(
            f"interrupted during bench_{current}; finished: {finished}; nothing recorded",
            file=sys.stderr,
        )
        return 130
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = f"# Benchmark results\n\nRecorded {stamp} by `make bench` on: {machine()}."
    if not argv:
        from chart import ratio_svg

        (HERE / "RESULTS.md").write_text(render(rows, header))
        (HERE / "RESULTS.svg").write_text(
            ratio_svg(rows, f"kvevents against same-run baselines ({stamp})")
        )
        print(f"recorded in {HERE / 'RESULTS.md'} and {HERE / 'RESULTS.svg'}")
        record_hooks(names, by_name)
    elif partial:
        path = HERE / "RESULTS.md"
        existing = path.read_text() if path.exists() else header + "\n"
        note = (
            f"Recorded {stamp} by `python bench/run.py --record {' '.join(names)}` on: {machine()}."
        )
        path.write_text(merge(existing, rows, note))
        print(f"recorded the sections of {', '.join(names)} in {path}")
        record_hooks(names, by_name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
