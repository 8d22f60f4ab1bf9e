"""The bounds of a worker registration's fields, wherever one comes from.

A registration arrives over HTTP (``POST /register``), from a state file, or as a scale-out
worker record; each is checked against the same bounds, so that what one path accepts the
others can hold. Each is a msgspec annotation: a value outside it is refused naming the field
and the rule (``Expected `int` <= 1024 - at `$.ranks```). Pure: msgspec only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_NAME_LEN",
    "MAX_RANK",
    "MAX_RANKS",
    "BlockSize",
    "EndpointText",
    "Name",
    "Rank",
    "RankCount",
    "Text",
]

#: The largest block size accepted (engines use 16 to a few hundred tokens).
MAX_BLOCK_SIZE = 1 << 20
#: The most ranks one worker may register (attention-DP sizes are far below it).
MAX_RANKS = 1024
#: The largest rank number: rank r publishes on base port + r, and ports end at 65535.
MAX_RANK = 65535
#: The longest worker id, model name, topic or other name.
MAX_NAME_LEN = 256
_ENDPOINT_LEN = 1024

BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
RankCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_LEN)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]
EndpointText = Annotated[str, msgspec.Meta(min_length=1, max_length=_ENDPOINT_LEN)]
