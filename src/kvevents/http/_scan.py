"""The JSON scanners of HTTP request bodies: the C module when it is built, else Python.

``kvevents.http._jsonscan`` (C) and ``kvevents.http._scan_py`` (the reference) share one API;
this module re-exports one of them. ``KVEVENTS_PURE_PYTHON=1`` forces the reference, as it does
the index's tables. :data:`IMPLEMENTATION` says which was picked (``"c"`` or ``"python"``);
:data:`FALLBACK_REASON` says why not C.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

from kvevents.http import _scan_py

__all__ = ["FALLBACK_REASON", "IMPLEMENTATION", "pack_json_member", "pack_json_tokens"]


def _select() -> tuple[ModuleType, str | None]:
    if os.environ.get("KVEVENTS_PURE_PYTHON") == "1":
        return _scan_py, "KVEVENTS_PURE_PYTHON=1"
    try:
        from kvevents.http import _jsonscan
    except ImportError as exc:
        return _scan_py, f"{type(exc).__name__}: {exc}"
    return _jsonscan, None


_impl, FALLBACK_REASON = _select()

if TYPE_CHECKING:
    # One static type for both: the C module's stub declares the same signatures.
    from kvevents.http._scan_py import IMPLEMENTATION, pack_json_member, pack_json_tokens
else:
    IMPLEMENTATION = _impl.IMPLEMENTATION
    pack_json_member = _impl.pack_json_member
    pack_json_tokens = _impl.pack_json_tokens
