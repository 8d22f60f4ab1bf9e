"""Exact text -> token ids with a cache of the text between added tokens.

A Hugging Face fast tokenizer splits its added tokens (``<|im_start|>``, ``<|eot_id|>``, ...)
out of the text first, longest match leftmost, and then normalizes, pre-tokenizes and runs the
model on each piece between them on its own. So the ids of a text are the ids of its pieces
and added tokens, concatenated, and a piece's ids depend only on the piece. A chat rendered by
its template is mostly pieces seen before (every earlier turn of the conversation, the system
prompt, the role headers), so keeping ``piece -> ids`` makes later turns cheap while the ids
stay exactly what the whole-text encode gives. The post-processor (the BOS or EOS that
``add_special_tokens`` adds) applies to the whole and is added around the concatenation.

That holds only for pipelines whose steps work piece by piece: :func:`segment_independence`
checks the tokenizer's own description (``tokenizer.json``) against the steps known to, and
:class:`Encoder` falls back to the whole-text encode for the rest (never a guess).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

__all__ = ["Encoder", "segment_independence"]

# Normalizers and pre-tokenizers that act on each piece alone, whatever came before it. Not
# here on purpose: Metaspace (its "first" scheme looks at the piece's offset in the text),
# Prepend/Strip/Replace (kept out to stay on the side of what has been checked), ByteLevel with
# a prefix space.
_PIECEWISE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_PIECEWISE_PRE_TOKENIZERS = {
    "Split",
    "Digits",
    "Punctuation",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "UnicodeScripts",
}
#: Bounds of the cache: pieces kept and their total length in characters.
MAX_PIECES = 65536
MAX_CHARS = 16_000_000


def _step_reason(step: Mapping[str, Any] | None, kind: str, allowed: set[str]) -> str | None:
    """Why a normalizer or pre-tokenizer step is not piecewise, or None when it is."""
    if step is None:
        return None
    name = step.get("type")
    if name == "Sequence":
        inner = step.get("normalizers" if kind == "normalizer" else "pretokenizers") or []
        return next((r for s in inner if (r := _step_reason(s, kind, allowed))), None)
    if name == "ByteLevel" and kind == "pre_tokenizer":
        return None if not step.get("add_prefix_space") else "ByteLevel adds a prefix space"
    return None if name in allowed else f"{kind} {name}"


def _added_reason(added: Sequence[Mapping[str, Any]], normalizer: object) -> str | None:
    """Why the added tokens do not split text the way a plain leftmost-longest search does."""
    for token in added:
        for flag in ("lstrip", "rstrip", "single_word"):
            if token.get(flag):
                return f"added token {token.get('content')!r} has {flag}"
    if len({bool(token.get("normalized")) for token in added}) > 1:
        return "added tokens mix normalized and raw matching"
    if added and added[0].get("normalized") and normalizer is not None:
        return "added tokens are matched after normalization"
    return None


def segment_independence(backend: Tokenizer) -> str | None:
    """None when ``backend`` encodes a text as its pieces between added tokens, else why not."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    checks = (
        "split special tokens is on" if backend.encode_special_tokens else None,
        f"model dropout {model['dropout']}" if model.get("dropout") else None,
        _step_reason(spec.get("normalizer"), "normalizer", _PIECEWISE_NORMALIZERS),
        _step_reason(spec.get("pre_tokenizer"), "pre_tokenizer", _PIECEWISE_PRE_TOKENIZERS),
        _added_reason(spec.get("added_tokens") or [], spec.get("normalizer")),
    )
    return next((reason for reason in checks if reason), None)


class _Pieces:
    """A bounded LRU of piece -> ids (tuples, never handed out: callers get copies)."""

    def __init__(self, max_pieces: int, max_chars: int) -> None:
        self.max_pieces = max_pieces
        self.max_chars = max_chars
        self.chars = 0
        self.hits = 0
        self.misses = 0
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def get(self, piece: str) -> tuple[int, ...] | None:
        ids = self._ids.get(piece)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._ids.move_to_end(piece)
        return ids

    def put(self, piece: str, ids: tuple[int, ...]) -> None:
        if piece in self._ids or len(piece) > self.max_chars:
            return
        self._ids[piece] = ids
        self.chars += len(piece)
        while len(self._ids) > self.max_pieces or self.chars > self.max_chars:
            old, _ = self._ids.popitem(last=False)
            self.chars -= len(old)

    def __len__(self) -> int:
        return len(self._ids)


class Encoder:
    """Text -> ids as ``tokenizer(text, add_special_tokens=...)`` gives them, cached by piece.

    Built from a fast tokenizer's backend (a private copy: the caller's tokenizer keeps its own
    truncation and padding state), the ids the post-processor adds (``prefix``, ``suffix``),
    and whether pieces may be cached (``why_uncached`` None). Safe to share between threads:
    the copy is never reconfigured and the cache is only touched under the GIL.
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        prefix: Sequence[int],
        suffix: Sequence[int],
        split_special_tokens: bool,
        max_pieces: int = MAX_PIECES,
        max_chars: int = MAX_CHARS,
    ) -> None:
        self._backend = Tokenizer.from_str(backend.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = split_special_tokens
        self.prefix = list(prefix)
        self.suffix = list(suffix)
        self.why_uncached = segment_independence(self._backend)
        self._pieces = _Pieces(max_pieces, max_chars)
        added = self._backend.get_added_tokens_decoder()
        self._added = {token.content: token_id for token_id, token in added.items()}
        # Longest first: at a position, the first alternative that matches is the longest.
        names = sorted(self._added, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, names))) if names else None

    def reset_counts(self) -> None:
        """Zero the hit and miss counts (the cache keeps its pieces)."""
        self._pieces.hits = self._pieces.misses = 0

    @property
    def stats(self) -> tuple[int, int, int]:
        """(pieces held, lookups that hit, lookups that missed)."""
        return len(self._pieces), self._pieces.hits, self._pieces.misses

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``, with the post-processor's ids when ``add_special_tokens``."""
        body = self.encode_whole(text) if self.why_uncached else self._encode_pieces(text)
        return [*self.prefix, *body, *self.suffix] if add_special_tokens else body

    def encode_whole(self, text: str) -> list[int]:
        """The ids of ``text`` from one encode of the whole (no cache, no special tokens)."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def _encode_pieces(self, text: str) -> list[int]:
        parts = list(self._split(text))
        known = self._lookup(parts)
        ids: list[int] = []
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(known[part])
        return ids

    def _lookup(self, parts: Sequence[str | int]) -> dict[str, tuple[int, ...]]:
        """Each distinct piece's ids: from the cache, the rest in one batch encode."""
        known: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        for part in parts:
            if isinstance(part, str) and part not in known:
                cached = self._pieces.get(part)
                if cached is None:
                    missing.append(part)
                    known[part] = ()
                else:
                    known[part] = cached
        if missing:
            encoded = self._backend.encode_batch(missing, add_special_tokens=False)
            for piece, encoding in zip(missing, encoded, strict=True):
                known[piece] = tuple(encoding.ids)
                self._pieces.put(piece, known[piece])
        return known

    def _split(self, text: str) -> Iterable[str | int]:
        """The pieces of ``text`` (str) and its added tokens (their ids), in order."""
        if self._pattern is None:
            yield text
            return
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                yield text[start : match.start()]
            yield self._added[match.group()]
            start = match.end()
        if start < len(text):
            yield text[start:]
