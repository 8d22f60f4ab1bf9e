"""The front door's layer (``kvevents route``): exact prompt tokens, in process.

Every name loads on first use (the tokenizer parts import ``transformers``, from the
``route`` extra). Names are kept one per line, sorted, so additions merge cleanly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.errors import TokenizerNotFound
    from kvevents.route._tokens import (
        EngineOptions,
        ModelTokenizer,
        Prompt,
        TokenizerStats,
        parse_tokenize_reply,
        tokenize_request,
    )

__all__ = [
    "EngineOptions",
    "ModelTokenizer",
    "Prompt",
    "TokenizerNotFound",
    "TokenizerStats",
    "parse_tokenize_reply",
    "tokenize_request",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.errors": ("TokenizerNotFound",),
        "kvevents.route._tokens": (
            "EngineOptions",
            "ModelTokenizer",
            "Prompt",
            "TokenizerStats",
            "parse_tokenize_reply",
            "tokenize_request",
        ),
    },
)
