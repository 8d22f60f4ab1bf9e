"""Package faces whose names load on first use, so importing a light module of a package never
loads the heavy ones (ZeroMQ, pydantic, the HTTP stack) that its neighbours need."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    homes: Mapping[str, Sequence[str]],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:  # a package attribute: any object
    """``__getattr__`` and ``__dir__`` for ``package``, whose names live in the modules of
    ``homes`` (module -> names). A name is imported once and then kept in the package."""
    where = {name: module for module, names in homes.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:  # a package attribute: any kind of object
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
