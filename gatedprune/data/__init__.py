"""Sentence pairs for translation: where they come from (``bible``, ``sources``), the tokenizer, token-budget
batches, and the Lightning data modules that put them together (``datamodule``)."""

from gatedprune.data.batching import EpochShuffle, FixedBatches, TokenizedPairs, collate_pairs, token_budget_batches
from gatedprune.data.bible import (
    BIBLE_DB, BIBLE_EVAL_PAIRS, BIBLE_MAX_CHARS, clean_verse, load_bible_pairs, split_bible_pairs,
)
from gatedprune.data.datamodule import SPLITS, BibleData, FilesData, HFData, TranslationDataModule
from gatedprune.data.sources import drop_empty_pairs, is_header, load_hf_pairs, pairs_from_columns, read_pairs_file
from gatedprune.data.tokenizer import SPECIAL_TOKENS, set_language_codes, train_unigram_tokenizer

__all__ = [
    "BIBLE_DB", "BIBLE_EVAL_PAIRS", "BIBLE_MAX_CHARS", "SPECIAL_TOKENS", "SPLITS", "BibleData", "EpochShuffle",
    "FilesData", "FixedBatches", "HFData", "TokenizedPairs", "TranslationDataModule", "clean_verse", "collate_pairs",
    "drop_empty_pairs", "is_header", "load_bible_pairs", "load_hf_pairs", "pairs_from_columns", "read_pairs_file",
    "set_language_codes", "split_bible_pairs", "token_budget_batches", "train_unigram_tokenizer",
]
