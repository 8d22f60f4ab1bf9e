"""The small files an operator names (a settings file, a state file, a token), read bounded.

A path can name anything: ``/dev/zero`` or ``/dev/urandom`` is read without end, and a file of
gigabytes fills memory before any parser sees it. :func:`read_bounded` reads a regular file or
a pipe (``--config <(...)``), at most ``limit`` bytes, and refuses devices, directories and
sockets and a file over the limit with an ``OSError`` whose ``strerror`` says which rule (the
caller names the file and the option it came from).
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_bounded"]


def read_bounded(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of ``path``, a regular file or a pipe of at most ``limit`` bytes; ``what``
    names the kind of file in the error (``"settings file"``)."""
    kind = _not_a_file(os.stat(path).st_mode)
    if kind is not None:
        raise OSError(errno.EINVAL, f"{kind}, not a regular file: a {what} is read from a file")
    with open(path, "rb") as f:
        data = f.read(limit + 1)  # one byte more tells a file of exactly ``limit`` from more
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"over {limit} bytes, the largest {what} read")
    return data


def _not_a_file(mode: int) -> str | None:
    """What ``mode`` describes when it is neither a regular file nor a pipe."""
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
        return None
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a socket" if stat.S_ISSOCK(mode) else "not a file"
