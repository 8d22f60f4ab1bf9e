"""The package imports and exposes its public face."""

import kvevents


def test_public_names_resolve() -> None:
    """Every name in __all__ is importable from the top-level package."""
    missing = [name for name in kvevents.__all__ if not hasattr(kvevents, name)]
    assert missing == []
