"""The ``--curve-*`` options shared by the commands that open sockets (``docs/security.md``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvevents.cli.common import UsageError

if TYPE_CHECKING:
    from kvevents.security import CurveClient, CurveServer

__all__ = ["add_client_options", "add_server_options", "client_curve", "server_curve"]


def add_server_options(p: argparse.ArgumentParser) -> None:
    """``--curve-secret`` and ``--curve-allow`` for a command that binds (publish)."""
    g = p.add_argument_group("encryption (CurveZMQ, see docs/security.md)")
    g.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="encrypt: this publisher's NAME.key_secret (from 'kvevents keys "
        "generate'); subscribers need the matching NAME.key",
    )
    g.add_argument(
        "--curve-allow",
        metavar="DIR",
        help="admit only the clients whose public NAME.key files are in DIR",
    )


def add_client_options(p: argparse.ArgumentParser) -> None:
    """``--curve-server-key`` and ``--curve-secret`` for a command that connects."""
    g = p.add_argument_group("encryption (CurveZMQ, see docs/security.md)")
    g.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="the publisher is encrypted: its public NAME.key file",
    )
    g.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="this client's NAME.key_secret (needed by a publisher with an "
        "allow-list; default: a fresh key pair)",
    )


def server_curve(args: argparse.Namespace) -> CurveServer | None:
    """The ``CurveServer`` the options name, or None (plain wire)."""
    if args.curve_secret is None:
        if args.curve_allow is not None:
            raise UsageError("--curve-allow needs --curve-secret (the publisher's own keys)")
        return None
    from kvevents.security import CurveServer

    try:
        return CurveServer.from_files(args.curve_secret, args.curve_allow)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def client_curve(args: argparse.Namespace) -> CurveClient | None:
    """The ``CurveClient`` the options name, or None (plain wire)."""
    if args.curve_server_key is None:
        if args.curve_secret is not None:
            raise UsageError("--curve-secret needs --curve-server-key (the publisher's key)")
        return None
    from kvevents.security import CurveClient

    try:
        return CurveClient.from_files(args.curve_server_key, args.curve_secret)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
