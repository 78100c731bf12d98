"""A Lightning data module of sentence pairs: one language direction, tokenised, in token-budget batches.

``TranslationDataModule`` does what every source shares (tokenizer, language codes, caps, batching, resume); each
source (``data=bible``, ``data=files``, ``data=hf``: its own ``_target_``) says only how it reads its splits.
Training pairs go into batches of at most ``max_tokens`` padded tokens, grouped by length; the batch order is
reshuffled every epoch from (seed, epoch) alone.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import lightning
import transformers
from torch.utils.data import DataLoader

from gatedprune.data.batching import EpochShuffle, FixedBatches, TokenizedPairs, collate_pairs, token_budget_batches
from gatedprune.data.bible import BIBLE_MAX_CHARS, load_bible_pairs, split_bible_pairs
from gatedprune.data.sources import drop_empty_pairs, load_hf_pairs, read_pairs_file
from gatedprune.data.tokenizer import set_language_codes, train_unigram_tokenizer

Pair = tuple[str, str]
SPLITS = ("train", "validation", "test")  # the test split is optional for the hf and files sources

# Lightning warns that a mid-epoch resume replays the epoch from its start; this module's sampler resumes exactly
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def _check_split_names(given: dict, name: str, required: tuple[str, ...]) -> None:
    unknown = [split for split in given if split not in SPLITS]
    if unknown:
        raise ValueError(f"{name} has an unknown split {unknown[0]!r}; allowed: {list(SPLITS)}")
    missing = [split for split in required if split not in given]
    if missing:
        raise ValueError(f"{name} has no entry for split {missing[0]!r}; given: {sorted(given)}")


class TranslationDataModule(lightning.LightningDataModule):
    """Sentence pairs of one language direction, tokenised, in token-budget training batches.

    Call ``prepare_tokenizer()`` first when the model needs the vocabulary (it is idempotent; ``setup`` calls it).
    Without ``tokenizer_path`` a shared Unigram tokenizer is trained on the training split and saved to
    ``tokenizer_dir``; pass that directory as ``tokenizer_path`` later to reuse it.
    """

    source = "?"  # set by each source below: bible, files, hf

    def __init__(
        self,
        src_lang: str = "en",
        tgt_lang: str = "fr",
        tokenizer_path: str | None = None,
        vocab_size: int = 8000,
        tokenizer_dir: str = "tokenizer",
        max_tokens: int = 4096,
        max_length: int = 48,
        max_chars: int | None = None,  # pairs with a side longer than this many characters do not train
        max_dropped_fraction: float = 0.5,  # more training pairs than this dropped by max_chars/max_length: refused
        eval_batch_size: int = 64,
        max_train_pairs: int | None = None,
        max_val_pairs: int | None = None,
        max_test_pairs: int | None = None,
        required_splits: tuple[str, ...] = ("train", "validation"),  # what training needs; evaluation needs less
        num_workers: int = 0,
        seed: int = 1234,
        src_lang_code: str | None = None,  # a multilingual tokenizer's language codes (mBART-50, M2M100, NLLB)
        tgt_lang_code: str | None = None,
        source_prefix: str = "",  # prepended to every source text: T5's task prefix, "translate English to French: "
    ) -> None:
        super().__init__()
        if max_tokens < max_length:
            raise ValueError(f"max_tokens={max_tokens} must be at least max_length={max_length}")
        fraction_ok = isinstance(max_dropped_fraction, (int, float)) and not isinstance(max_dropped_fraction, bool)
        if not (fraction_ok and 0 <= max_dropped_fraction <= 1):  # nan fails the comparison too
            shown = repr(max_dropped_fraction) if isinstance(max_dropped_fraction, str) else max_dropped_fraction
            raise ValueError(f"data.max_dropped_fraction={shown}; allowed: a number from 0 to 1")
        self.max_dropped_fraction = max_dropped_fraction
        self.max_positions: int | None = None  # the model's (limit_positions): longer evaluation pairs are cut
        self._train_read = (0, 0)  # (training pairs looked at, dropped for max_chars): load_pairs counts them
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.tokenizer_path, self.vocab_size, self.tokenizer_dir = tokenizer_path, vocab_size, tokenizer_dir
        self.max_tokens, self.max_length, self.max_chars = max_tokens, max_length, max_chars
        self.eval_batch_size = eval_batch_size
        self.max_train_pairs, self.max_val_pairs, self.max_test_pairs = max_train_pairs, max_val_pairs, max_test_pairs
        self.required_splits = tuple(required_splits)
        self.num_workers, self.seed = num_workers, seed
        self.lang_codes = {"src_lang": src_lang_code, "tgt_lang": tgt_lang_code}
        self.source_prefix = source_prefix
        self.pairs: dict[str, list[Pair]] | None = None
        self.tokenizer: transformers.PreTrainedTokenizerBase | None = None
        self.datasets: dict[str, TokenizedPairs] | None = None
        self.batches: dict[str, list[list[int]]] | None = None
        # (epoch, training batches of it already used) where a resumed run picks up; Lightning draws the first
        # batch before it calls set_epoch, so the sampler must know the epoch from the start
        self._resume_at = (0, 0)
        self._references = None  # the references' dataset and batches while other targets train (set_train_targets)

    def read_splits(self) -> dict[str, list[Pair]]:
        """(source, target) strings per split, as the source has them: each source says how."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Where the pairs come from and how many each split holds (for reports)."""
        return {"source": self.source, "pairs": {split: len(d) for split, d in (self.datasets or {}).items()}}

    def load_pairs(self) -> dict[str, list[Pair]]:
        """Raw (source, target) strings per split, before any tokenisation: empty pairs dropped, caps applied."""
        pairs = self.read_splits()
        for split, split_pairs in pairs.items():
            pairs[split] = drop_empty_pairs(split_pairs, f"split {split!r}")
        if "train" in pairs:
            train, cap = pairs["train"], self.max_train_pairs
            keep = [i for i, p in enumerate(train) if self.max_chars is None or max(map(len, p)) <= self.max_chars]
            if len(keep) < len(train):
                print(f"split 'train': dropped {len(train) - len(keep)} of {len(train)} pairs with a side longer than "
                      f"data.max_chars={self.max_chars} characters")
            # the cap below keeps the first pairs that pass: the fraction dropped is of those read up to the last one
            used = len(keep) if cap is None else min(cap, len(keep))
            looked_at = keep[used - 1] + 1 if 0 < used < len(keep) else len(train)
            self._train_read = (looked_at, looked_at - used)
            pairs["train"] = [train[i] for i in keep]
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

    def _tokenize(self, pairs: list[Pair], max_length: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
        src_texts, tgt_texts = (list(side) for side in zip(*pairs))
        src_texts = [self.source_prefix + text for text in src_texts]
        cut = {"truncation": True, "max_length": max_length} if max_length else {}  # keeps the end-of-sequence
        return self.tokenizer(src_texts, **cut)["input_ids"], self.tokenizer(text_target=tgt_texts, **cut)["input_ids"]

    def limit_positions(self, model) -> None:
        """Evaluation pairs longer than ``model``'s positions (``max_position_embeddings``) are cut to them in
        ``setup``; call it first. A model without the limit (T5's relative positions) cuts nothing."""
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    def _check_dropped(self, tokenized: int, kept: int, refuse: bool) -> None:
        """Say how many training pairs max_length dropped; refuse (``refuse``: to train) when, with those max_chars
        dropped, more than ``max_dropped_fraction`` of the pairs read is gone: a training set so cut is a mistake."""
        if kept < tokenized:
            print(f"split 'train': dropped {tokenized - kept} of {tokenized} pairs longer than "
                  f"data.max_length={self.max_length} tokens")
        looked_at, dropped = self._train_read
        looked_at, dropped = max(looked_at, tokenized), dropped + tokenized - kept
        if refuse and dropped > self.max_dropped_fraction * looked_at:
            chars = f" or data.max_chars={self.max_chars} characters" if self.max_chars is not None else ""
            raise ValueError(
                f"{dropped} of {looked_at} training pairs are longer than data.max_length={self.max_length} tokens"
                f"{chars} ({dropped / looked_at:.0%} > data.max_dropped_fraction={self.max_dropped_fraction}); "
                f"allowed: at most that fraction dropped: raise data.max_length{chars and ' or data.max_chars'}, "
                "or data.max_dropped_fraction (up to 1)"
            )

    def _cut_to_positions(self, split: str, pairs: list[Pair], src_ids: list, tgt_ids: list) -> None:
        """Re-tokenise the pairs of an evaluation split longer than the model's positions, cut to them (in place);
        their texts stay whole: the reference is what the data says."""
        limit = self.max_positions
        long = [i for i in range(len(pairs)) if max(len(src_ids[i]), len(tgt_ids[i])) > limit] if limit else []
        if long:
            for i, src, tgt in zip(long, *self._tokenize([pairs[i] for i in long], max_length=limit)):
                src_ids[i], tgt_ids[i] = src, tgt
            print(f"split {split!r}: cut {len(long)} of {len(pairs)} pairs to the model's {limit} positions "
                  "(sources and targets truncated)")

    def setup(self, stage: str | None = None) -> None:
        """Tokenise every split, drop over-long training pairs, cut over-long evaluation pairs, fix the batches."""
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
                self._check_dropped(len(pairs), len(keep), refuse=stage != "test")  # evaluation does not train
                pairs, src_ids, tgt_ids = ([seq[i] for i in keep] for seq in (pairs, src_ids, tgt_ids))
                lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
                self.batches[split] = token_budget_batches(lengths, self.max_tokens)
            else:
                self._cut_to_positions(split, pairs, src_ids, tgt_ids)
                order = sorted(range(len(pairs)), key=lambda i: len(src_ids[i]))
                size = self.eval_batch_size
                self.batches[split] = [order[i : i + size] for i in range(0, len(order), size)]
            self.datasets[split] = TokenizedPairs(pairs, src_ids, tgt_ids)

    def set_train_targets(self, texts: list[str] | None, keep_references: bool = False) -> None:
        """Train on ``texts`` instead of the references (sequence-level distillation's translations of the sources,
        in order: one per training pair, or per pair of the first ``len(texts)``), tokenised as references are, cut to
        ``max_length``, and batched to the token budget anew; with ``keep_references`` every reference trains too,
        the translations as pairs of their own after them. ``None`` puts the references back. Validation and test
        keep theirs."""
        if self._references is not None:
            self.datasets["train"], self.batches["train"] = self._references
            self._references = None
        if texts is None:
            return
        dataset = self.datasets["train"]
        if not 0 < len(texts) <= len(dataset):
            raise ValueError(f"{len(texts)} training targets for {len(dataset)} training pairs; allowed: one per pair "
                             "(or per pair of the first N)")
        tgt_ids = self.tokenizer(text_target=list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        pairs = [(src, text) for (src, _), text in zip(dataset.pairs, texts)]
        src_ids = dataset.src_ids[: len(texts)]
        if keep_references:
            pairs, src_ids, tgt_ids = (list(dataset.pairs) + pairs, list(dataset.src_ids) + src_ids,
                                       list(dataset.tgt_ids) + tgt_ids)
        self._references = (dataset, self.batches["train"])
        self.datasets["train"] = TokenizedPairs(pairs, src_ids, tgt_ids)
        lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
        self.batches["train"] = token_budget_batches(lengths, self.max_tokens)

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


class BibleData(TranslationDataModule):
    """``data=bible``: the built-in EN-FR corpus (World English Bible -> Louis Segond 1910), split with a fixed seed.

    Codes: "4" World English Bible, "l" Louis Segond 1910, "v" Reina Valera 1909 (others exist in the database).
    ``max_chars`` caps both sides before the split, so it defines the corpus here (all three splits).
    """

    source = "bible"

    def __init__(self, bible_src: str = "4", bible_tgt: str = "l", split_seed: int = 1234,
                 max_chars: int = BIBLE_MAX_CHARS, **common) -> None:
        super().__init__(max_chars=None, **common)
        self.bible_src, self.bible_tgt, self.split_seed, self.corpus_max_chars = bible_src, bible_tgt, split_seed, max_chars

    def read_splits(self) -> dict[str, list[Pair]]:
        return split_bible_pairs(load_bible_pairs(self.bible_src, self.bible_tgt, self.corpus_max_chars), self.split_seed)

    def describe(self) -> dict:
        return {**super().describe(), "source": f"bible {self.bible_src}->{self.bible_tgt}"}


class FilesData(TranslationDataModule):
    """``data=files``: one local file per split (train and validation required, test optional)."""

    source = "files"

    def __init__(self, files: dict[str, str | None] | None = None, files_header: bool | None = None,
                 src_key: str | None = None, tgt_key: str | None = None, **common) -> None:
        super().__init__(**common)
        self.files = {split: path for split, path in (files or {}).items() if path is not None}
        self.files_header = files_header  # a TSV's first line: None detects a header, True skips it, False keeps it
        self.src_key, self.tgt_key = src_key or self.src_lang, tgt_key or self.tgt_lang

    def read_splits(self) -> dict[str, list[Pair]]:
        _check_split_names(self.files, "files", self.required_splits)
        return {split: read_pairs_file(path, self.src_key, self.tgt_key, self.files_header)
                for split, path in self.files.items()}

    def describe(self) -> dict:
        return {**super().describe(), "source": f"files {self.files}"}


class HFData(TranslationDataModule):
    """``data=hf``: a Hugging Face dataset (hub id, data-file directory, or a ``save_to_disk`` directory).

    ``splits`` maps our split names to the dataset's (slices such as "train[:1000000]" pass through).
    """

    source = "hf"

    def __init__(self, hf_name: str | None = None, hf_config: str | None = None,
                 splits: dict[str, str] | None = None, src_key: str | None = None, tgt_key: str | None = None,
                 **common) -> None:
        super().__init__(**common)
        self.hf_name, self.hf_config = hf_name, hf_config
        self.splits = dict(zip(SPLITS, SPLITS)) if splits is None else {k: v for k, v in splits.items() if v}
        self.src_key, self.tgt_key = src_key or self.src_lang, tgt_key or self.tgt_lang

    def read_splits(self) -> dict[str, list[Pair]]:
        if self.hf_name is None:
            raise ValueError("data=hf needs data.hf_name (a hub id or a local dataset directory), got None")
        _check_split_names(self.splits, "splits", self.required_splits)
        return load_hf_pairs(self.hf_name, self.hf_config, self.splits, self.src_key, self.tgt_key)

    def describe(self) -> dict:
        return {**super().describe(), "source": f"hf {self.hf_name} {self.hf_config or ''}".strip()}
