"""Tokenizers: a Unigram tokenizer trained on the training split, and a pretrained one's language codes."""

from __future__ import annotations

import json

import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>", "<s>")  # ids 0, 1, 2, 3 in a trained tokenizer

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
