"""Deterministic request workloads shared by the benchmarks."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

from pagedserve.engine.config import bundled_text_path


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


def default_text_path() -> str:
    """The book the engine ships (engine/data/, public domain), or $PAGEDSERVE_TEXT if set."""
    path = os.environ.get("PAGEDSERVE_TEXT") or bundled_text_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file {path} not found; pass --text PATH or set PAGEDSERVE_TEXT")
    return path


def load_words(path: str | None = None) -> list[str]:
    with open(path or default_text_path(), encoding="utf-8") as f:
        text = f.read()
    start = text.find("It is a truth universally acknowledged")  # skip the Gutenberg header if present
    return text[max(start, 0):].split()


def skewed_lengths(n: int, median: int, longest: int, rng: random.Random) -> list[int]:
    """Log-normal output lengths with the given median, clipped to [1, longest]; the max is `longest`."""
    sigma = math.log(longest / median) / 2.4
    lengths = [max(1, min(longest, round(median * math.exp(rng.gauss(0, sigma))))) for _ in range(n)]
    lengths[max(range(n), key=lengths.__getitem__)] = longest
    return lengths


def prose(n: int = 64, seed: int = 0, text_path: str | None = None, min_words: int = 40, max_words: int = 200,
          median_out: int = 32, max_out: int = 256) -> list[Request]:
    """Prompts cut from the book (min..max words), outputs of skewed length."""
    rng = random.Random(seed)
    words = load_words(text_path)
    outs = skewed_lengths(n, median_out, max_out, rng)
    reqs = []
    for i in range(n):
        k = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words) - k)
        reqs.append(Request(" ".join(words[start:start + k]), outs[i]))
    return reqs


def shared_prefix(n: int = 32, seed: int = 0, text_path: str | None = None, prefix_words: int = 800,
                  num_prefixes: int = 4, suffix_words: int = 30, max_tokens: int = 32) -> list[Request]:
    """Groups of requests sharing a long common prefix (a system prompt or a document) + own question."""
    rng = random.Random(seed)
    words = load_words(text_path)
    prefixes = []
    for _ in range(num_prefixes):
        start = rng.randrange(0, len(words) - prefix_words)
        prefixes.append(" ".join(words[start:start + prefix_words]))
    reqs = []
    for i in range(n):
        start = rng.randrange(0, len(words) - suffix_words)
        reqs.append(Request(prefixes[i % num_prefixes] + "\n\n" + " ".join(words[start:start + suffix_words]),
                            max_tokens))
    return reqs
