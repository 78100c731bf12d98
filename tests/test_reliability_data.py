"""Data read as written and never dropped or cut without a word (issue 26, items 5 and 7).

Item 5: validation and test pairs longer than the model's positions are cut to them (training and
``gatedprune-evaluate``), counted in the log. Item 7: the file readers split lines on "\\n" only and strip a
byte-order mark; training pairs dropped for data.max_chars / data.max_length are counted, and a training set mostly
dropped is refused with the numbers.
"""

from __future__ import annotations

import json

import pytest
import transformers

from families import save_plain_mbart
from helpers import compose_train, error_line, run_train
from gatedprune.cli import evaluate_command
from gatedprune.data import FilesData, load_bible_pairs, read_pairs_file, train_unigram_tokenizer


@pytest.fixture(scope="module")
def pairs():
    return load_bible_pairs(max_chars=80)[:300]


@pytest.fixture(scope="module")
def long_pair(pairs):
    """One pair of about 3000 characters a side: several hundred tokens, more than any model here has positions."""
    return " ".join(s for s, _ in pairs[:60]), " ".join(t for _, t in pairs[:60])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, pairs):
    path = tmp_path_factory.mktemp("tok")
    train_unigram_tokenizer([t for pair in pairs for t in pair], 300).save_pretrained(path)
    return str(path)


def _write_tsv(path, pairs):
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    return str(path)


# ---- item 7: lines, byte-order marks ---------------------------------------------------------------------------


def test_readers_split_lines_on_newline_only(tmp_path):
    odd = "one\u2028two\u0085three\x0cfour\x1cfive\u2029six"  # all of these are line breaks to str.splitlines
    tsv = tmp_path / "odd.tsv"
    tsv.write_bytes(f"{odd}\tun\r\nplain\tdeux\n".encode())
    assert read_pairs_file(tsv, "en", "fr") == [(odd, "un"), ("plain", "deux")]  # "\r\n" tolerated
    jsonl = tmp_path / "odd.jsonl"
    jsonl.write_bytes("".join(json.dumps({"en": odd, "fr": f"x{i}"}, ensure_ascii=False) + "\r\n"
                              for i in range(2)).encode())
    assert read_pairs_file(jsonl, "en", "fr") == [(odd, "x0"), (odd, "x1")]


def test_a_byte_order_mark_is_stripped(tmp_path, capsys):
    tsv = tmp_path / "bom.tsv"
    tsv.write_bytes("\ufeffen\tfr\nhello\tbonjour\n".encode())
    assert read_pairs_file(tsv, "en", "fr") == [("hello", "bonjour")]  # the header is seen, and skipped
    assert "skipped the header line" in capsys.readouterr().out
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(("\ufeff" + json.dumps({"en": "hello", "fr": "bonjour"}) + "\n").encode())
    assert read_pairs_file(jsonl, "en", "fr") == [("hello", "bonjour")]


# ---- item 7: dropped training pairs counted, a mostly dropped training set refused -----------------------------


def test_dropped_training_pairs_are_counted_in_the_log(tmp_path, pairs, tokenizer_dir, capsys):
    long_chars = sum(max(map(len, p)) > 60 for p in pairs[:100])
    files = {"train": _write_tsv(tmp_path / "train.tsv", pairs[:100]),
             "validation": _write_tsv(tmp_path / "dev.tsv", pairs[100:110])}
    dm = FilesData(files=files, tokenizer_path=tokenizer_dir, max_chars=60, max_length=25, max_dropped_fraction=1.0)
    dm.setup()
    out = capsys.readouterr().out
    assert 0 < long_chars < 100
    assert f"dropped {long_chars} of 100 pairs with a side longer than data.max_chars=60 characters" in out
    long_tokens = 100 - long_chars - len(dm.datasets["train"])
    assert long_tokens > 0
    assert f"dropped {long_tokens} of {100 - long_chars} pairs longer than data.max_length=25 tokens" in out


def test_a_mostly_dropped_training_set_is_refused_with_the_numbers(tmp_path, pairs, tokenizer_dir):
    files = {"train": _write_tsv(tmp_path / "train.tsv", pairs[:100]),
             "validation": _write_tsv(tmp_path / "dev.tsv", pairs[100:110])}
    dm = FilesData(files=files, tokenizer_path=tokenizer_dir, max_chars=60, max_length=20)
    with pytest.raises(ValueError) as info:
        dm.setup()
    message = str(info.value)
    kept = FilesData(files=files, tokenizer_path=tokenizer_dir, max_chars=60, max_length=20, max_dropped_fraction=1)
    kept.setup()  # the same data is taken when the user allows it
    dropped = 100 - len(kept.datasets["train"])
    assert dropped > 50 and "\n" not in message
    assert message.startswith(f"{dropped} of 100 training pairs are longer than data.max_length=20 tokens or "
                              f"data.max_chars=60 characters ({dropped}% > data.max_dropped_fraction=0.5)"), message
    assert "allowed" in message
    evaluating = FilesData(files=files, tokenizer_path=tokenizer_dir, max_chars=60, max_length=20)
    evaluating.setup("test")  # evaluation (gatedprune-evaluate, analyze) scores another split: it does not train
    assert len(evaluating.datasets["train"]) == 100 - dropped
    for bad in (-0.1, 1.5, float("nan"), "half"):
        with pytest.raises(ValueError, match=r"data.max_dropped_fraction=.*allowed: a number from 0 to 1"):
            FilesData(files=files, max_dropped_fraction=bad)


def test_a_training_run_on_a_mostly_dropped_training_set_is_refused_in_one_line(tmp_path, pairs):
    train = _write_tsv(tmp_path / "train.tsv", pairs[:100])
    proc = run_train(tmp_path / "run", "data=files", f"data.files.train={train}", f"data.files.validation={train}",
                     "data.max_length=20")
    assert proc.returncode == 2 and " training pairs are longer than data.max_length=20 tokens or data.max_chars=100 " \
        "characters (" in error_line(proc)
    assert not (tmp_path / "run").exists()


def test_the_cap_on_training_pairs_counts_only_the_pairs_it_looked_at(tmp_path, pairs, tokenizer_dir):
    """max_train_pairs keeps the first N pairs that pass max_chars: the fraction is of the pairs read up to there."""
    files = {"train": _write_tsv(tmp_path / "train.tsv", pairs[:100]),
             "validation": _write_tsv(tmp_path / "dev.tsv", pairs[100:110])}
    short = [i for i, p in enumerate(pairs[:100]) if max(map(len, p)) <= 60]
    dm = FilesData(files=files, tokenizer_path=tokenizer_dir, max_chars=60, max_length=20, max_train_pairs=10)
    with pytest.raises(ValueError, match=rf"of {short[9] + 1} training pairs are longer"):
        dm.setup()


def test_the_shipped_presets_drop_less_than_the_limit(tmp_path, capsys):
    from hydra.utils import instantiate

    cfg = compose_train(tmp_path, "experiment=smoke")
    dm = instantiate(cfg.data, tokenizer_dir=str(tmp_path / "tok"), _convert_="all")
    dm.setup()
    assert len(dm.datasets["train"]) > cfg.data.max_train_pairs * (1 - cfg.data.max_dropped_fraction)


# ---- item 5: evaluation pairs longer than the model's positions ------------------------------------------------


def test_long_evaluation_pairs_are_cut_to_the_model_positions(tmp_path, pairs, long_pair, tokenizer_dir, capsys):
    files = {"train": _write_tsv(tmp_path / "train.tsv", pairs[:100]),
             "validation": _write_tsv(tmp_path / "dev.tsv", [long_pair, *pairs[100:105]]),
             "test": _write_tsv(tmp_path / "test.tsv", [*pairs[105:110], long_pair])}
    dm = FilesData(files=files, tokenizer_path=tokenizer_dir, max_length=64)
    dm.max_positions = 100
    dm.setup()
    out = capsys.readouterr().out
    tokenizer = dm.tokenizer
    full = tokenizer(long_pair[0])["input_ids"]
    assert len(full) > 100
    for split in ("validation", "test"):
        data = dm.datasets[split]
        assert max(len(ids) for ids in data.src_ids + data.tgt_ids) == 100
        assert f"split {split!r}: cut 1 of 6 pairs to the model's 100 positions" in out
        i = data.pairs.index(long_pair)  # the texts stay whole: the reference is what the file says
        assert data.src_ids[i][-1] == full[-1] and data.src_ids[i][:50] == full[:50]  # the end-of-sequence kept
    assert max(max(len(s), len(t)) for s, t in zip(dm.datasets["train"].src_ids, dm.datasets["train"].tgt_ids)) <= 64


def test_a_training_run_with_a_long_validation_sentence(tmp_path, pairs, long_pair):
    train = _write_tsv(tmp_path / "train.tsv", pairs[:200])
    dev = _write_tsv(tmp_path / "dev.tsv", [*pairs[200:210], long_pair])
    proc = run_train(tmp_path / "run", "data=files", f"data.files.train={train}", f"data.files.validation={dev}",
                     f"data.files.test={dev}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split 'validation': cut 1 of 11 pairs to the model's 256 positions" in proc.stdout


def test_evaluate_a_test_file_with_a_long_sentence(tmp_path, pairs, long_pair, tokenizer_dir, capsys):
    model_dir = tmp_path / "model"
    save_plain_mbart(model_dir, transformers.AutoTokenizer.from_pretrained(tokenizer_dir), width=16)
    test = _write_tsv(tmp_path / "test.tsv", [*pairs[:5], long_pair])
    assert evaluate_command([str(model_dir), "data=files", f"data.files.test={test}", "--num-beams", "1",
                             "--out", str(tmp_path / "eval.json")]) == 0
    assert "split 'test': cut 1 of 6 pairs to the model's 128 positions" in capsys.readouterr().out
    assert json.loads((tmp_path / "eval.json").read_text())["sentences"] == 6
