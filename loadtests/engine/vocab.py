"""A small byte-level BPE vocabulary (GPT-2 style) for the test model, built in code.

Any text tokenizes: the 256 byte tokens cover every input. Common English words are whole tokens
(each reachable through a chain of merges), so a prompt costs roughly one token per 4-5 characters
as with real models, and generated text reads as words.

Each token also gets an output bias class. Tokens that would make generated text awkward for a
proxy to carry — the end-of-text token (it would end generations at random), control characters
and lone bytes of multi-byte UTF-8 sequences — are never generated; whole words are preferred.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cache

EOS_TEXT = "<|endoftext|>"

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_UNUSED = 5

WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at",
    "by", "be", "this", "from", "or", "have", "an", "are", "not", "but", "all", "they", "we", "can",
    "one", "were", "which", "their", "there", "been", "has", "more", "will", "if", "so", "no",
    "out", "up", "about", "into", "than", "them", "some", "could", "time", "only", "other", "new",
    "these", "two", "may", "then", "first", "any", "like", "now", "over", "such", "our", "man",
    "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through",
    "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each",
    "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world",
    "still", "own", "see", "men", "work", "long", "here", "get", "both", "between", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great",
    "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take",
    "three", "small", "water", "light", "stone", "river", "model", "token", "stream", "gateway",
    "answer", "request", "server", "client", "fast", "slow", "quiet", "clear", "bright", "open",
    "close", "early", "late", "north", "south", "east", "west", "green", "blue", "red", "white",
    "black", "warm", "cold", "high", "low", "near", "far", "simple", "steady", "every", "again",
    "often",
)  # fmt: skip


class Bias(IntEnum):
    """How a token's output logit is shifted (see `model.py`)."""

    BANNED = 0
    PIECE = 1
    WORD = 2


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bias: list[Bias]
    eos_id: int


def byte_symbols() -> list[str]:
    """The printable character standing for each byte in a byte-level BPE vocabulary.

    Bytes that are visible, non-space Latin-1 characters stand for themselves; the others
    (controls, space, a few Latin-1 gaps) are moved to code points from 256 up, in byte order.
    Space becomes "Ġ" and newline "Ċ", as llama.cpp's BPE tokenizer expects.
    """
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols: list[str] = []
    moved = 0
    for byte in range(256):
        if byte in visible:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + moved))
            moved += 1
    return symbols


def _byte_bias(byte: int) -> Bias:
    # Only printable ASCII may be generated: a lone byte >= 0x80 is half a UTF-8 character.
    return Bias.PIECE if 0x20 <= byte < 0x7F else Bias.BANNED


@cache
def build_vocab(size: int = 0) -> Vocab:
    """The vocabulary, padded with unused tokens up to `size` tokens if that is larger.

    Padding makes the output layer as wide as a real model's (128k tokens or so): decoding pays
    for every vocabulary entry at each token, a prompt's prefill only once.
    """
    symbols = byte_symbols()
    tokens = [EOS_TEXT]
    types = [TOKEN_CONTROL]
    bias = [Bias.BANNED]
    for byte, symbol in enumerate(symbols):
        tokens.append(symbol)
        types.append(TOKEN_NORMAL)
        bias.append(_byte_bias(byte))

    # Words with their leading space, as GPT-2 style pre-tokenization splits text. A word
    # becomes one token through merges of its prefixes ("Ġ t" -> "Ġt", "Ġt h" -> "Ġth", ...);
    # listing shorter prefixes first gives them the lower (earlier applied) merge ranks.
    space = symbols[ord(" ")]
    words = [space + word for word in dict.fromkeys(WORDS)]
    index = {token: i for i, token in enumerate(tokens)}
    merges: list[str] = []
    for length in range(2, max(len(w) for w in words) + 1):
        for word in words:
            if len(word) < length or word[:length] in index:
                continue
            piece = word[:length]
            merges.append(f"{piece[:-1]} {piece[-1]}")
            index[piece] = len(tokens)
            tokens.append(piece)
            types.append(TOKEN_NORMAL)
            bias.append(Bias.PIECE)
    for word in words:
        bias[index[word]] = Bias.WORD
    for unused in range(len(tokens), size):
        tokens.append(f"<unused{unused}>")
        types.append(TOKEN_UNUSED)
        bias.append(Bias.BANNED)
    return Vocab(tokens=tokens, types=types, merges=merges, bias=bias, eos_id=0)
