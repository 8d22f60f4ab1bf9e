"""The ``kvevents`` command: one module per subcommand, a shared parser with one-line errors.

Each subcommand module defines ``add_parser(subparsers)`` and ``run(args) -> int``. The
library never prints; only this package writes to the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvevents.cli.common import UsageError
from kvevents.errors import KVEventsError

__all__ = ["main"]

# Subcommand modules, in the order --help lists them.
COMMANDS = (
    "listen",
    "replay",
    "publish",
    "simulate",
    "serve",
    "keys",
    "conformance",
    "bench",
    "demo",
)


# Optional packages by the extra that installs them (the core needs only pyzmq, msgspec and
# pydantic): a command whose extra is missing still shows up, and says what to install.
EXTRAS = {
    "xxhash": "index",
    "starlette": "service",
    "uvicorn": "service",
    "httptools": "service",
    "prometheus_client": "metrics",
    "rich": "cli",
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one clear line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> Parser:
    """The full parser with every available subcommand."""
    parser = Parser(
        prog="kvevents",
        description="Stream, watch, replay, simulate and index KV cache events.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'kvevents COMMAND --help' for examples.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kvevents.cli.{name}")
            module.add_parser(sub)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing not in EXTRAS:
                raise
            _add_unavailable(sub, name, missing)
    return parser


def _add_unavailable(sub: Any, name: str, missing: str) -> None:
    """A stand-in for a command whose optional dependency is not installed."""
    extra = EXTRAS[missing]
    why = f"needs the optional package {missing!r}: pip install 'kvevents[{extra}]'"
    # No option prefix: whatever follows (even --help) lands in "rest", and run() explains.
    p = sub.add_parser(
        name,
        help=f"(not installed: kvevents[{extra}])",
        description=why,
        prefix_chars="\0",
        add_help=False,
    )
    p.add_argument("rest", nargs="*")

    def run(args: argparse.Namespace) -> int:
        print(f"kvevents {name}: error: {why}", file=sys.stderr)
        return 1

    p.set_defaults(run=run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvevents`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        print(f"kvevents {args.command}: error: {exc} (see --help)", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error; keep Python from complaining.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in EXTRAS:
            raise
        print(
            f"kvevents {args.command}: error: needs the optional package {missing!r}: "
            f"pip install 'kvevents[{EXTRAS[missing]}]'",
            file=sys.stderr,
        )
        return 1
    except (KVEventsError, ValueError, OSError, RuntimeError) as exc:
        print(f"kvevents {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
