"""``kvevents keys``: CURVE key pairs for encrypted streams (``docs/security.md``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvevents.cli.common import UsageError

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers

EXAMPLES = """examples:
  kvevents keys generate keys/ --name engine-a
      keys/engine-a.key (public: give it to subscribers) and keys/engine-a.key_secret
      (mode 0600: keep it on the engine's host)
  kvevents publish --curve-secret keys/engine-a.key_secret
  kvevents listen tcp://10.0.0.5:5557 --curve-server-key keys/engine-a.key
      an encrypted stream and a subscriber that knows the publisher's public key
  kvevents keys generate clients/ --name router-1
  kvevents publish --curve-secret keys/engine-a.key_secret --curve-allow clients/
  kvevents listen tcp://10.0.0.5:5557 --curve-server-key keys/engine-a.key \\
      --curve-secret clients/router-1.key_secret
      only the clients whose public keys are in clients/ may connect
"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "keys",
        help="create CURVE key pairs for encrypted streams",
        description="Create the key files that --curve-secret, --curve-server-key and "
        "--curve-allow read (ZeroMQ certificate format).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    gen = actions.add_parser(
        "generate",
        help="write NAME.key and NAME.key_secret into DIR",
        description="Write a new key pair: DIR/NAME.key (public) and DIR/NAME.key_secret "
        "(mode 0600). Existing files are never overwritten.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("directory", metavar="DIR", help="where to write (created if missing)")
    gen.add_argument("--name", default="kvevents", help="file name stem (default kvevents)")
    gen.set_defaults(run=run)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvevents.security import load_public_key, save_keypair

    try:
        public_file, secret_file = save_keypair(args.directory, args.name)
    except (ValueError, FileExistsError) as exc:
        raise UsageError(str(exc)) from None
    print(f"public key: {public_file} ({load_public_key(public_file)})")
    print(f"secret key: {secret_file} (mode 0600: keep it private)")
    return 0
