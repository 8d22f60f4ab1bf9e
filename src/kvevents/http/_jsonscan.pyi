"""The C JSON scanners (``_jsonscan.c``): the API of :mod:`kvevents.http._scan_py`."""

from typing import Final

from typing_extensions import Buffer

IMPLEMENTATION: Final[str]

def pack_json_tokens(raw: Buffer | str, /) -> bytes | None: ...
def pack_json_member(body: Buffer, key: Buffer, /) -> tuple[bytes, int, int] | None: ...
