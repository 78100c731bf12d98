"""TranslationDataModule: Bible cleaning and split, tokenizer, token-budget batches, file and HF sources, errors."""

from __future__ import annotations

import json
import re
import sqlite3

import datasets
import lightning
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from gatedprune.data import (
    BIBLE_DB,
    BIBLE_EVAL_PAIRS,
    EpochShuffle,
    BibleData,
    FilesData,
    HFData,
    TranslationDataModule,
    clean_verse,
    load_bible_pairs,
    train_unigram_tokenizer,
)

SMALL = dict(vocab_size=500, max_train_pairs=300, max_tokens=512, max_length=64, eval_batch_size=32)
MARKERS = re.compile(r"[\[\]`\xad\t]|\(\d+:\d+|  ")


@pytest.fixture(scope="module")
def bible_dm(tmp_path_factory) -> TranslationDataModule:
    dm = BibleData(tokenizer_dir=str(tmp_path_factory.mktemp("tok") / "tokenizer"), **SMALL)
    dm.setup()
    return dm


@pytest.fixture(scope="module")
def bible_pairs() -> list[tuple[str, str]]:
    return load_bible_pairs("4", "l")[:120]


def _raw_verses(code: str, pattern: str) -> list[str]:
    with sqlite3.connect(f"file:{BIBLE_DB}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT vText FROM bible WHERE bbName = ? AND vText LIKE ?", (code, pattern))
        return [text for (text,) in rows]


def test_cleaning_removes_markers_on_real_rows():
    numbered = _raw_verses("l", "(%:%)%")  # Segond's inline verse numbers, e.g. "(9:2) ..."
    bracketed = _raw_verses("4", "%[%]%")  # WEB's supplied words, e.g. "ten [shekels]"
    inverted = _raw_verses("v", "%\xad%")  # Reina Valera's "¡" stored as a soft hyphen
    assert len(numbered) > 1000 and len(bracketed) > 1000 and len(inverted) > 100
    for text in numbered + bracketed + inverted + _raw_verses("4", "%`%") + _raw_verses("v", "%\t%"):
        assert not MARKERS.search(clean_verse(text)), text
    assert clean_verse("(9:3) Je ferai de toi le sujet de ma joie,") == "Je ferai de toi le sujet de ma joie,"
    assert clean_verse("ten [shekels], full of incense;") == "ten shekels, full of incense;"  # supplied words stay
    assert clean_verse("God`s Spirit") == "God's Spirit"
    assert clean_verse("\t Y dijo: \xadMoisés!") == "Y dijo: ¡Moisés!"
    for src, tgt in load_bible_pairs("4", "l", max_chars=10_000) + load_bible_pairs("4", "v", max_chars=10_000):
        assert src and tgt and not MARKERS.search(src) and not MARKERS.search(tgt)


def test_bible_pairs_respect_max_chars_and_are_distinct():
    pairs = load_bible_pairs("4", "l", max_chars=80)
    assert 1000 < len(pairs) == len(set(pairs))
    assert max(max(len(src), len(tgt)) for src, tgt in pairs) <= 80
    assert ("In the beginning God created the heavens and the earth.",
            "Au commencement, Dieu créa les cieux et la terre.") in pairs


def test_bible_split_is_fixed_and_disjoint():
    first = BibleData(seed=1).load_pairs()
    second = BibleData(seed=2).load_pairs()  # the training seed must not move the split
    assert first == second
    assert len(first["validation"]) == len(first["test"]) == BIBLE_EVAL_PAIRS
    assert len(first["train"]) == len(load_bible_pairs()) - 2 * BIBLE_EVAL_PAIRS
    sets = {split: set(pairs) for split, pairs in first.items()}
    assert not sets["train"] & sets["validation"] and not sets["train"] & sets["test"]
    assert not sets["validation"] & sets["test"]
    assert BibleData(split_seed=7).load_pairs()["test"] != first["test"]


def test_trained_tokenizer_round_trips_appends_eos_and_is_saved(bible_dm):
    tok = bible_dm.tokenizer
    assert len(tok) == 500 and tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "</s>", "<unk>", "<s>"]
    texts = [text for pair in bible_dm.pairs["train"][:100] for text in pair]
    decoded = [tok.decode(ids, skip_special_tokens=True) for ids in tok(texts)["input_ids"]]
    assert sum(d == t for d, t in zip(decoded, texts)) >= 0.95 * len(texts)
    for ids in tok(texts[:10])["input_ids"] + tok(text_target=texts[:10])["input_ids"]:
        assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
    reloaded = transformers.AutoTokenizer.from_pretrained(bible_dm.tokenizer_dir)
    assert reloaded(texts[:10])["input_ids"] == tok(texts[:10])["input_ids"]
    assert bible_dm.prepare_tokenizer() is tok  # idempotent
    assert train_unigram_tokenizer(texts, 500).get_vocab() == train_unigram_tokenizer(texts, 500).get_vocab()


def test_training_batches_respect_token_budget_and_length_filter(bible_dm):
    seen = []
    for batch in bible_dm.train_dataloader():
        assert batch.keys() == {"input_ids", "attention_mask", "labels"}
        assert batch["input_ids"].numel() <= SMALL["max_tokens"] and batch["labels"].numel() <= SMALL["max_tokens"]
        assert max(batch["input_ids"].shape[1], batch["labels"].shape[1]) <= SMALL["max_length"]
        seen.append(batch["input_ids"].shape[0])
    kept = len(bible_dm.datasets["train"])
    assert sum(seen) == kept and len(seen) > 5
    assert 0 < kept < SMALL["max_train_pairs"]  # some long pairs were dropped


def test_validation_keeps_every_pair_with_matching_texts(bible_dm):
    tok = bible_dm.tokenizer
    batches = list(bible_dm.val_dataloader())
    assert sum(len(batch["src_texts"]) for batch in batches) == BIBLE_EVAL_PAIRS
    assert max(batch["labels"].shape[1] for batch in batches) > SMALL["max_length"]  # long pairs stay
    assert {p for b in batches for p in zip(b["src_texts"], b["tgt_texts"])} == set(bible_dm.pairs["validation"])
    batch = batches[-1]
    assert len(batch["src_texts"]) == batch["input_ids"].shape[0] <= SMALL["eval_batch_size"]
    for row, (src, tgt) in enumerate(zip(batch["src_texts"], batch["tgt_texts"])):
        src_ids, tgt_ids = tok(src)["input_ids"], tok(text_target=tgt)["input_ids"]
        assert batch["input_ids"][row, : len(src_ids)].tolist() == src_ids
        assert batch["labels"][row, : len(tgt_ids)].tolist() == tgt_ids


def test_padding_masks_and_labels(bible_dm):
    batch = next(iter(bible_dm.test_dataloader()))
    pad_id = bible_dm.tokenizer.pad_token_id
    lengths = [len(bible_dm.tokenizer(text_target=t)["input_ids"]) for t in batch["tgt_texts"]]
    assert len(set(lengths)) > 1  # the batch really has padding
    for row, length in enumerate(lengths):
        assert (batch["labels"][row, length:] == -100).all() and (batch["labels"][row, :length] >= 0).all()
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.long
    assert ((batch["attention_mask"] == 0) == (batch["input_ids"] == pad_id)).all()


def test_batch_order_depends_on_seed_and_epoch_only(bible_dm):
    def order(dm, epoch):
        loader = dm.train_dataloader()
        loader.batch_sampler.sampler.set_epoch(epoch)
        return [batch["input_ids"][0].tolist() for batch in loader]

    resumed = BibleData(tokenizer_path=bible_dm.tokenizer_dir, **SMALL)  # a fresh process, same seed
    resumed.setup()
    assert order(bible_dm, 0) != order(bible_dm, 1)
    assert order(resumed, 1) == order(bible_dm, 1)
    assert list(EpochShuffle(50, seed=1)) != list(EpochShuffle(50, seed=2))


def test_epoch_shuffle_shards_one_permutation_across_ddp_ranks():
    whole = list(EpochShuffle(11, seed=3, epoch=2))
    shards = [list(EpochShuffle(11, seed=3, epoch=2, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]  # 11 // 3 each: every process takes the same number of steps
    assert [whole[i] for i in range(9)] == [shards[i % 3][i // 3] for i in range(9)]  # round-robin, last 2 dropped
    resumed = EpochShuffle(11, seed=3, epoch=2, skip=2, rank=1, world_size=3)  # skip counts this rank's batches
    assert list(resumed) == shards[1][2:] and list(resumed) == shards[1]
    with pytest.raises(ValueError, match="rank=3 with world_size=3"):
        EpochShuffle(11, seed=3, rank=3, world_size=3)


class _RecordFirstIds(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.first_ids: dict[int, list[int]] = {}
        self.val_texts: list[str] = []

    def training_step(self, batch, batch_idx):
        self.first_ids.setdefault(self.current_epoch, batch["input_ids"][0].tolist())
        return (self.weight - 1.0) ** 2

    def validation_step(self, batch, batch_idx):
        assert len(batch["tgt_texts"]) == batch["labels"].shape[0]
        self.val_texts += batch["tgt_texts"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_sets_the_epoch_of_the_batch_order(tmp_path, bible_dm):
    model = _RecordFirstIds()
    trainer = lightning.Trainer(
        max_epochs=2, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0, accelerator="cpu",
        default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=bible_dm)
    for epoch in (0, 1):
        shuffle = EpochShuffle(len(bible_dm.batches["train"]), bible_dm.seed)
        shuffle.set_epoch(epoch)
        first_batch = bible_dm.batches["train"][next(iter(shuffle))]
        src_ids = bible_dm.datasets["train"][first_batch[0]][0]
        assert model.first_ids[epoch][: len(src_ids)] == src_ids
    assert model.first_ids[0] != model.first_ids[1]
    assert len(model.val_texts) == 2 * SMALL["eval_batch_size"]  # one validation batch per epoch


def _write_split_files(directory, pairs, suffix: str, nested: bool) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    chunks = {"train": pairs[:80], "validation": pairs[80:100], "test": pairs[100:120]}
    files = {}
    for split, chunk in chunks.items():
        path = directory / f"{split}{suffix}"
        rows = [{"translation": {"en": s, "fr": t}} if nested else {"en": s, "fr": t} for s, t in chunk]
        if suffix == ".tsv":
            path.write_text("".join(f"{s}\t{t}\n" for s, t in chunk), encoding="utf-8")
        elif suffix == ".jsonl":
            path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        else:
            pq.write_table(pa.Table.from_pylist(rows), path)
        files[split] = str(path)
    return files


@pytest.mark.parametrize(
    "suffix, nested", [(".tsv", False), (".jsonl", False), (".jsonl", True), (".parquet", False), (".parquet", True)]
)
def test_local_files_load(tmp_path, bible_dm, bible_pairs, suffix, nested):
    files = _write_split_files(tmp_path, bible_pairs, suffix, nested)
    dm = FilesData(files=files, tokenizer_path=bible_dm.tokenizer_dir, max_length=200)
    dm.setup()
    assert dm.pairs["validation"] == bible_pairs[80:100] and len(dm.datasets["train"]) == 80
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "src_texts", "tgt_texts"}


def test_files_source_trains_its_own_tokenizer(tmp_path, bible_pairs):
    files = _write_split_files(tmp_path, bible_pairs, ".tsv", nested=False)
    dm = FilesData(files=files, vocab_size=300, tokenizer_dir=str(tmp_path / "tok"), max_val_pairs=5
    )
    assert dm.prepare_tokenizer().eos_token_id == 1 and (tmp_path / "tok" / "tokenizer.json").is_file()
    assert dm.pairs["validation"] == bible_pairs[80:85]


def test_test_split_is_optional_for_files(tmp_path, bible_dm, bible_pairs):
    files = _write_split_files(tmp_path, bible_pairs, ".tsv", nested=False)
    del files["test"]
    dm = FilesData(files=files, tokenizer_path=bible_dm.tokenizer_dir, max_length=200)
    dm.setup()
    assert len(dm.val_dataloader()) == 1
    with pytest.raises(ValueError, match="no test split"):
        dm.test_dataloader()


def test_hf_dataset_saved_to_disk_and_data_file_directory(tmp_path, bible_dm, bible_pairs, monkeypatch):
    chunks = {"train": bible_pairs[:80], "dev": bible_pairs[80:100], "test": bible_pairs[100:120]}
    saved = datasets.DatasetDict({  # WMT's layout: one "translation" column of dicts
        split: datasets.Dataset.from_dict({"translation": [{"en": s, "fr": t, "de": "-"} for s, t in chunk]})
        for split, chunk in chunks.items()
    })
    saved.save_to_disk(tmp_path / "saved")
    splits = {"train": "train", "validation": "dev", "test": "test"}
    dm = HFData(hf_name=str(tmp_path / "saved"), splits=splits,
                               tokenizer_path=bible_dm.tokenizer_dir, max_length=200)
    dm.setup()
    assert dm.pairs["validation"] == bible_pairs[80:100] and len(dm.pairs["train"]) == 80

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / "jsonl"  # train.jsonl, validation.jsonl, test.jsonl: load_dataset names splits by file
    directory.mkdir()
    _write_split_files(directory, bible_pairs, ".jsonl", nested=False)
    pairs = HFData(hf_name=str(directory)).load_pairs()
    assert pairs["test"] == bible_pairs[100:120]


def _error(source: str = "bible", **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        dm = {"bible": BibleData, "files": FilesData, "hf": HFData}[source](**kwargs)
        dm.setup()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_inputs_raise_one_line_value_errors(tmp_path, bible_dm, bible_pairs):
    files = _write_split_files(tmp_path, bible_pairs, ".jsonl", nested=False)
    nested = _write_split_files(tmp_path / "nested", bible_pairs, ".parquet", nested=True)
    assert "'zz'" in (m := _error(bible_tgt="zz")) and "'l'" in m
    assert "'de'" in (m := _error(source="files", files=files, tgt_lang="de")) and "['en', 'fr']" in m
    assert "'de'" in (m := _error(source="files", files=nested, tgt_key="de")) and "['en', 'fr']" in m
    no_validation = {k: v for k, v in files.items() if k != "validation"}
    assert "'validation'" in (m := _error(source="files", files=no_validation)) and "['test', 'train']" in m
    assert "'dev'" in (m := _error(source="files", files={**files, "dev": files["test"]})) and "'test'" in m
    assert "'.csv'" in (m := _error(source="files", files={**files, "test": "x.csv"})) and ".parquet" in m
    assert "missing.tsv" in _error(source="files", files={**files, "test": str(tmp_path / "missing.tsv")})
    m = _error(source="files", files=files, max_length=1, tokenizer_path=bible_dm.tokenizer_dir)
    assert "all 80 training pairs" in m and "max_length=1" in m
    saved = datasets.DatasetDict(train=datasets.Dataset.from_dict({"en": ["a"], "fr": ["b"]}))
    saved.save_to_disk(tmp_path / "saved")
    assert "'validation'" in (m := _error(source="hf", hf_name=str(tmp_path / "saved"))) and "['train']" in m
    assert "hf_name" in _error(source="hf")
