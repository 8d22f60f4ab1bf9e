"""The piece cache gives exactly the whole-text encode, and stays off where it could not."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from kvevents.route._segments import Encoder, segment_independence
from kvevents.testing.chat_model import ADDED_TOKENS, SPECIAL_TOKENS

TOKENS = (*SPECIAL_TOKENS, *ADDED_TOKENS)
# Text built of words, unicode that normalizes, whitespace, whole and broken special tokens.
_PIECES = st.sampled_from(
    [
        "hello",
        " world",
        "\n\n",
        "  ",
        "\t",
        "e\u0301",
        "\u212a",
        "日本語",
        "😀👍🏽",
        "\u200b",
        "<|im_",
        "im_end|>",
        "<",
        "|>",
        "1234567",
        *TOKENS,
    ]
)
TEXTS = st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=24).map("".join)


@pytest.fixture(scope="module")
def hf(chat_model_tokenizer: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model_tokenizer), truncation_side="left")


def _encoder(hf: object, **bounds: int) -> Encoder:
    backend = hf.backend_tokenizer  # type: ignore[attr-defined]
    bos = hf.bos_token_id  # type: ignore[attr-defined]
    return Encoder(backend, prefix=[bos], suffix=[], split_special_tokens=False, **bounds)


def _bare(hf: object, text: str, special: bool) -> list[int]:
    return list(hf(text, add_special_tokens=special)["input_ids"])  # type: ignore[operator]


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=4), special=st.booleans())
def test_pieces_give_the_whole_text_ids(hf: object, texts: list[str], special: bool) -> None:
    """Any text (special tokens inside, whole or broken) encodes exactly as the tokenizer does."""
    encoder = _encoder(hf)
    assert encoder.why_uncached is None
    for text in texts:  # later texts reuse the pieces of earlier ones
        assert encoder.encode(text, special) == _bare(hf, text, special)


def test_a_growing_conversation_hits_the_cache_and_stays_exact(hf: object) -> None:
    """Each turn re-encodes only its new pieces; every turn's ids equal the whole encode."""
    encoder = _encoder(hf)
    text = "<|bos|>"
    for turn in range(20):
        text += f"<|im_start|>user\nquestion {turn} é 😀<|im_end|>\n<|im_start|>assistant\nanswer {turn}<|im_end|>\n"
        assert encoder.encode(text, False) == _bare(hf, text, False)
    pieces, hits, misses = encoder.stats
    # New per turn: its two messages; "\n" once. Every other lookup is a hit.
    assert misses == 2 * 20 + 1 and hits > 9 * misses, (pieces, hits, misses)


def test_the_cache_is_bounded_and_eviction_keeps_ids_exact(hf: object) -> None:
    """Past its bounds the cache drops the oldest pieces; the ids never change."""
    encoder = _encoder(hf, max_pieces=3, max_chars=40)
    texts = [f"<|im_start|>piece number {i} with some words<|im_end|>" for i in range(30)]
    for text in texts + texts[::-1]:
        assert encoder.encode(text, True) == _bare(hf, text, True)
    pieces, _, _ = encoder.stats
    assert pieces <= 3


def test_a_piece_longer_than_the_cache_is_encoded_and_not_kept(hf: object) -> None:
    """A piece over ``max_chars`` is encoded exactly and never stored."""
    encoder = _encoder(hf, max_chars=10)
    text = "a long piece of text that does not fit"
    assert encoder.encode(text, False) == _bare(hf, text, False)
    assert encoder.stats[0] == 0


def _tokenizer(**parts: object) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = parts.get("pre_tokenizer", pre_tokenizers.Whitespace())  # type: ignore[assignment]
    if "normalizer" in parts:
        tokenizer.normalizer = parts["normalizer"]  # type: ignore[assignment]
    tokenizer.add_special_tokens(
        parts.get("added", [AddedToken("<s>", special=True, normalized=False)])
    )  # type: ignore[arg-type]
    return tokenizer


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ({"pre_tokenizer": pre_tokenizers.Metaspace()}, "pre_tokenizer Metaspace"),
        ({"pre_tokenizer": pre_tokenizers.ByteLevel(add_prefix_space=True)}, "prefix space"),
        ({"normalizer": normalizers.Prepend("x")}, "normalizer Prepend"),
        ({"added": [AddedToken("<s>", lstrip=True, special=True)]}, "lstrip"),
        ({"added": [AddedToken("<s>", rstrip=True, special=True)]}, "rstrip"),
        ({"added": [AddedToken("<s>", single_word=True, special=True)]}, "single_word"),
        (
            {"added": [AddedToken("<s>", normalized=False), AddedToken("<t>", normalized=True)]},
            "mix normalized",
        ),
        (
            {"normalizer": normalizers.NFKC(), "added": [AddedToken("<s>", normalized=True)]},
            "after normalization",
        ),
    ],
)
def test_pipelines_that_are_not_piecewise_are_not_cached(
    parts: dict[str, object], reason: str
) -> None:
    """Metaspace, prefix spaces, prepending normalizers, stripping or normalized added tokens:
    the cache stays off (and says why), and the ids are the whole-text encode's."""
    tokenizer = _tokenizer(**parts)
    why = segment_independence(tokenizer)
    assert why is not None and reason in why
    encoder = Encoder(tokenizer, prefix=[], suffix=[], split_special_tokens=False)
    assert encoder.why_uncached == why
    for text in ("a b<s>b a", "<s> a", "a<s>"):
        assert encoder.encode(text, False) == tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.stats[0] == 0


def test_split_special_tokens_turns_the_cache_off(hf: object) -> None:
    """With special tokens encoded as text, the cache is off and the ids follow that mode."""
    encoder = Encoder(
        hf.backend_tokenizer,  # type: ignore[attr-defined]
        prefix=[],
        suffix=[],
        split_special_tokens=True,
    )
    assert encoder.why_uncached == "split special tokens is on"
    ids = encoder.encode("<|im_start|>x", False)
    assert 1 not in ids  # <|im_start|> is id 1 when matched as a special token


def test_the_callers_tokenizer_keeps_its_own_truncation_state(hf: object) -> None:
    """The encoder works on a copy: a truncating call on the tokenizer never truncates it."""
    encoder = _encoder(hf)
    text = "one two three four five six seven eight nine ten"
    hf(text, truncation=True, max_length=3)  # type: ignore[operator]
    assert encoder.encode(text, False) == _bare(hf, text, False)
    assert len(encoder.encode(text, False)) > 3


def test_added_tokens_are_matched_leftmost_then_longest() -> None:
    """Overlapping added tokens split as the tokenizer splits them: leftmost, then longest."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1, "y": 2, "d": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("ab", "abc", "bcd", "cd")])
    encoder = Encoder(tokenizer, prefix=[], suffix=[], split_special_tokens=False)
    assert encoder.why_uncached is None
    for text in ("abcd", "xabcdy", "abab", "bcdabc", "aabcd", "abcabcd"):
        assert (
            encoder.encode(text, False) == tokenizer.encode(text, add_special_tokens=False).ids
        ), text
