"""Type aliases for decoded documents: JSON bodies and answers, TOML settings tables.

A decoded document's values are whatever its sender wrote; the code that reads one checks each
value it takes (a refusal names the field and the rule), so its static type cannot be narrower
than ``Any`` until then. These aliases name that once, instead of ``dict[str, Any]`` in every
signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

__all__ = ["Document", "DocumentView", "JSONValue"]

#: A decoded JSON object or TOML table (string keys), or one being built to be encoded.
Document: TypeAlias = dict[str, Any]
#: The same, read only.
DocumentView: TypeAlias = Mapping[str, Any]
#: One value of a decoded document (a member, an item), checked where it is read.
JSONValue: TypeAlias = Any
