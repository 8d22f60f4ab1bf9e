"""The bounds of a worker's registration, wherever it comes from.

A registration arrives over HTTP (``POST /register``, :mod:`kvevents.http`), from
a state file, from the settings (``--worker``, ``[[serve.workers]]``) or from what an engine
advertises (:mod:`kvevents.integrations.discovery`); each source holds it to these numbers, so
that none of them lets through what another refuses (``dp_size: 10**8`` once reached
``range()`` through discovery while HTTP said 400).
"""

from __future__ import annotations

__all__ = ["MAX_BLOCK_SIZE", "MAX_ENDPOINT_LENGTH", "MAX_NAME_LENGTH", "MAX_RANK", "MAX_RANKS"]

#: The largest block size accepted (engines use 16 to a few hundred tokens).
MAX_BLOCK_SIZE = 1 << 20
#: The most ranks one worker may register (attention-DP sizes are far below it).
MAX_RANKS = 1024
#: The largest rank number: rank r publishes on base port + r, and ports end at 65535.
MAX_RANK = 65535
#: The longest worker id, topic or model name, in characters.
MAX_NAME_LENGTH = 256
#: The longest endpoint, in characters.
MAX_ENDPOINT_LENGTH = 1024
