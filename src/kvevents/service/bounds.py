"""The bounds of a worker registration's fields, wherever one comes from.

A registration arrives over HTTP (``POST /register``), from a state file, or as a scale-out
worker record; each is checked against the same bounds, so that what one path accepts the
others can hold. The numbers are :mod:`kvevents.bounds`' (settings and discovery hold to them
too); here they are msgspec annotations: a value outside it is refused naming the field
and the rule (``Expected `int` <= 1024 - at `$.ranks```). Pure: msgspec only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvevents.bounds import (
    MAX_BLOCK_SIZE,
    MAX_ENDPOINT_LENGTH,
    MAX_NAME_LENGTH,
    MAX_RANK,
    MAX_RANKS,
)

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_NAME_LENGTH",
    "MAX_RANK",
    "MAX_RANKS",
    "BlockSize",
    "EndpointText",
    "Name",
    "Rank",
    "RankCount",
    "Text",
]

BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
RankCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_LENGTH)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LENGTH)]
EndpointText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENDPOINT_LENGTH)]
