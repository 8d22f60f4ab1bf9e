"""The ``kvevents`` command: one module per subcommand, a shared parser with one-line errors.

Each subcommand module defines ``add_parser(subparsers)`` and ``run(args) -> int``. The
library never prints; only this package writes to the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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
    "route",
    "relay",
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
    "nats": "nats",
    "transformers": "route",
    "tokenizers": "route",
}


# The extras each command needs, and the packages of each extra: a command checks them all
# before it starts, so one try names every missing package.
NEEDS = {
    "serve": ("service",),
    "simulate": ("index",),
    "demo": ("index", "cli"),
    "conformance": ("index",),
    "relay": ("nats",),
    "route": ("route",),
}
EXTRA_PACKAGES = {
    "index": ("xxhash",),
    "service": ("xxhash", "starlette", "uvicorn", "prometheus_client"),
    "cli": ("rich",),
    "metrics": ("prometheus_client",),
    "nats": ("nats",),
    "route": ("xxhash", "starlette", "uvicorn", "httptools", "prometheus_client", "transformers"),
}


def missing_packages(command: str) -> tuple[list[str], list[str]]:
    """The packages ``command`` needs that are not installed, and the extras that bring them."""
    packages: list[str] = []
    extras: list[str] = []
    for extra in NEEDS.get(command, ()):
        gone = [p for p in EXTRA_PACKAGES[extra] if importlib.util.find_spec(p) is None]
        if gone:
            extras.append(extra)
            packages.extend(p for p in gone if p not in packages)
    return packages, extras


def version_line() -> str:
    """``kvevents X.Y.Z`` and which native accelerators this install runs on."""
    from kvevents import __version__
    from kvevents.index import table_implementation
    from kvevents.subscribe import native_receive

    tables, why_not_c = table_implementation()
    index = "C" if tables == "c" else f"pure Python, about 4x slower ({why_not_c})"
    receive = "C" if native_receive() else "pyzmq"
    return f"kvevents {__version__} (index tables: {index}; message receive: {receive})"


def _warn_if_slow() -> None:
    """Say once, on stderr, when the index runs without its C tables for a reason the user did
    not choose (no compiler at install time): everything works, about 4x slower."""
    from kvevents.index import table_implementation

    tables, why_not_c = table_implementation()
    if tables != "c" and os.environ.get("KVEVENTS_PURE_PYTHON") != "1":
        print(
            f"kvevents: note: the index runs on its pure-Python tables ({why_not_c}); "
            "reinstall with a C compiler for about 4x the speed",
            file=sys.stderr,
        )


class _Version(argparse.Action):
    """``--version``: computed only when asked, since it loads the native modules."""

    # argparse's Action.__call__ arguments, unused here.
    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_line())
        parser.exit(0)


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
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="print the version and native accelerators"
    )
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


def _add_unavailable(
    sub: argparse._SubParsersAction[Parser], name: str, missing: str
) -> None:  # typeshed names the subparsers action only privately
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
    packages, extras = missing_packages(args.command)
    if packages:
        print(
            f"kvevents {args.command}: error: needs {', '.join(map(repr, packages))}: "
            f"pip install 'kvevents[{','.join(extras)}]'",
            file=sys.stderr,
        )
        return 1
    if args.command in NEEDS:
        _warn_if_slow()
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
