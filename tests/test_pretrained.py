"""Pretrained models as users have them: their own tokenizer, language codes, T5's task prefix, Marian's vocabularies.

Tokenizers are built here from tiny vocabularies (no download); the model beside them is a tiny random one.
"""

import json

import pytest
import sentencepiece
import torch
import transformers

from gatedprune.data import FilesData, set_language_codes, train_unigram_tokenizer
from gatedprune.surgery.model_loading import start_with_target_language
from gatedprune.reports.support import tiny_config

CHARS = list("abcdefghijklmnopqrstuvwxyz")
CODES = ["eng_Latn", "fra_Latn", "deu_Latn"]


def nllb_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """An NLLB tokenizer over single characters, with three language codes."""
    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", "▁", *CHARS])}
    return transformers.NllbTokenizer(vocab=vocab, merges=[], extra_special_tokens=CODES)


def save_multilingual_model(path) -> None:
    """A tiny random M2M100 (NLLB's architecture) and its NLLB tokenizer, saved like a hub checkout."""
    tokenizer = nllb_tokenizer()
    config = tiny_config(transformers.M2M100Config())
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
    )
    config.decoder_start_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    transformers.M2M100ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_language_codes_frame_sources_and_targets_and_start_generation():
    tokenizer = nllb_tokenizer()
    set_language_codes(tokenizer, "deu_Latn", "fra_Latn")
    batch = tokenizer(["ab"], text_target=["cd"])
    assert tokenizer.convert_ids_to_tokens(batch["input_ids"][0])[0] == "deu_Latn"
    assert tokenizer.convert_ids_to_tokens(batch["labels"][0])[0] == "fra_Latn"
    config = tiny_config(transformers.M2M100Config())
    config.vocab_size = len(tokenizer)
    model = transformers.M2M100ForConditionalGeneration(config)
    start_with_target_language(model, tokenizer)
    assert model.generation_config.forced_bos_token_id == tokenizer.convert_tokens_to_ids("fra_Latn")


def test_unknown_language_code_is_refused_with_the_codes_it_has():
    with pytest.raises(ValueError, match=r"data.tgt_lang_code='fr_XX' is not a token of tokenizer NllbTokenizer; "
                                         r"its language codes include \['eng_Latn', 'fra_Latn', 'deu_Latn'\]"):
        set_language_codes(nllb_tokenizer(), "eng_Latn", "fr_XX")
    plain = train_unigram_tokenizer(["a b c d e f g"] * 10, 40)
    with pytest.raises(ValueError, match=r"data.src_lang_code='eng_Latn', but tokenizer \w+ has no language codes"):
        set_language_codes(plain, "eng_Latn", None)


def _files(tmp_path, pairs):
    rows = "".join(json.dumps({"en": s, "fr": t}) + "\n" for s, t in pairs)
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text(rows)
    return {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "validation")}


def test_source_prefix_goes_before_every_source(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    nllb_tokenizer().save_pretrained(tokenizer_dir)
    data = FilesData(files=_files(tmp_path, [("ab", "cd")] * 3), tokenizer_path=str(tokenizer_dir),
        source_prefix="xy ", max_tokens=64, max_length=16,
    )
    data.setup()
    source_ids = data.datasets["train"][0][0]
    assert data.tokenizer.convert_ids_to_tokens(source_ids)[1:-1] == ["▁", "x", "y", "▁", "a", "b"]


def _spm(tmp_path, name, text):
    (tmp_path / f"{name}.txt").write_text(text)
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / f"{name}.txt"), model_prefix=str(tmp_path / name), vocab_size=12,
        model_type="char", bos_id=-1, eos_id=1, unk_id=2, pad_id=0,
    )
    return tmp_path / f"{name}.model"


def test_marian_targets_use_the_target_vocabulary(tmp_path):
    source = _spm(tmp_path, "source", "abc abc cab bca\n" * 20)
    target = _spm(tmp_path, "target", "xyz zyx yxz\n" * 20)
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>", "▁", *"abcxyz"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(source), target_spm=str(target), vocab=str(tmp_path / "vocab.json"), separate_vocabs=False,
    )
    tokenizer.save_pretrained(tmp_path / "tok")
    data = FilesData(files=_files(tmp_path, [("abc", "xyz")] * 3), tokenizer_path=str(tmp_path / "tok"),
        max_tokens=64, max_length=16,
    )
    data.setup()
    source_ids, target_ids = data.datasets["train"][0][:2]
    assert data.tokenizer.convert_ids_to_tokens(target_ids)[-4:-1] == ["x", "y", "z"]
    assert data.tokenizer.convert_ids_to_tokens(source_ids)[-4:-1] == ["a", "b", "c"]


def test_pretrained_multilingual_model_fine_tunes_gated_and_exports(tmp_path):
    from helpers import compose_train

    from gatedprune.train import train

    model_dir = tmp_path / "nllb-tiny"
    save_multilingual_model(model_dir)
    out = tmp_path / "run"
    metrics = train(compose_train(
        out, "experiment=smoke", "model=pretrained", f"model.name_or_path={model_dir}",
        "data.src_lang_code=eng_Latn", "data.tgt_lang_code=fra_Latn", "data.max_train_pairs=64",
        "data.max_val_pairs=8", "data.max_test_pairs=8", "export.samples=8",
        # the toy NLLB tokenizer splits finely: 51 of the 64 verses exceed data.max_length; the 13 left are all this needs
        "data.max_dropped_fraction=0.9",
    ))
    assert metrics["export"]["verification"]["passed"]
    exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(out / "pruned", trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "pruned")
    assert exported.generation_config.forced_bos_token_id == tokenizer.convert_tokens_to_ids("fra_Latn")
    generated = exported.generate(**tokenizer(["abc"], return_tensors="pt"), max_new_tokens=3)
    assert generated[0, 1] == tokenizer.convert_tokens_to_ids("fra_Latn")  # after the decoder start token
