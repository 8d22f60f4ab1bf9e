"""A page of memory followed by an unreadable one, for tests of C code that reads bytes: data
placed flush against the end faults at once on a read past it (Linux: ``mmap``, then
``mprotect``).

::

    with guarded() as page:
        view = page.at_end(b"[1, 2, 3]")
        ...  # hand ``view`` to the C function
        view.release()  # before the page is unmapped
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import unittest
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PAGE", "GuardedPage", "guarded"]

#: The size of a page here: the most a guarded input can hold.
PAGE = mmap.PAGESIZE


class GuardedPage:
    """One readable page followed by an unreadable one."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        # mmap(addr, length, prot, flags, fd, offset)
        int_ = ctypes.c_int
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        if libc.mprotect(address + PAGE, PAGE, 0) != 0:
            libc.munmap(address, 2 * PAGE)
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self.libc, self.address = libc, address

    def at_end(self, data: bytes) -> memoryview:
        """``data`` copied so that it ends exactly where the readable page ends."""
        assert len(data) <= PAGE
        start = self.address + PAGE - len(data)
        ctypes.memmove(start, data, len(data))
        return memoryview((ctypes.c_char * len(data)).from_address(start)).cast("B")

    def close(self) -> None:
        self.libc.munmap(self.address, 2 * PAGE)


@contextmanager
def guarded() -> Iterator[GuardedPage]:
    """A :class:`GuardedPage`, unmapped after; elsewhere than Linux the test is skipped
    (``unittest.SkipTest``, which pytest reports as a skip)."""
    if not sys.platform.startswith("linux"):
        raise unittest.SkipTest("guard pages are set up with Linux mmap/mprotect")
    page = GuardedPage()
    try:
        yield page
    finally:
        page.close()
