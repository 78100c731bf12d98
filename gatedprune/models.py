"""Load a pretrained seq2seq model, or build one from a config, sized to the tokenizer."""

from __future__ import annotations

from pathlib import Path

import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gatedprune.adapters import ADAPTERS


def load_model(
    tokenizer: PreTrainedTokenizerBase,
    name_or_path: str | None = None,
    from_scratch: dict | None = None,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A supported seq2seq model: ``name_or_path`` (hub id or local dir) or, if that is None, a fresh one.

    ``from_scratch`` holds the config fields of the new model, ``model_type`` included (e.g. mbart, d_model,
    encoder_layers, ...). Vocabulary size and special token ids come from ``tokenizer``; the decoder starts
    with EOS, as mBART's label shift does.
    """
    if name_or_path is not None:
        return _load_pretrained(str(name_or_path), tokenizer, attn_implementation)
    if not from_scratch or "model_type" not in from_scratch:
        raise ValueError("model: set model.name_or_path (hub id or local directory) or model.from_scratch.model_type")
    fields = dict(from_scratch)
    model_type = fields.pop("model_type")
    if model_type not in ADAPTERS:
        raise ValueError(f"model.from_scratch.model_type={model_type!r} is not supported; allowed: {', '.join(sorted(ADAPTERS))}")
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
        **fields,
    )
    return transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attn_implementation)


def _load_pretrained(name_or_path: str, tokenizer: PreTrainedTokenizerBase, attn_implementation: str) -> PreTrainedModel:
    # a hub id is "name" or "org/name"; anything else is meant as a local path
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise ValueError(f"model.name_or_path={name_or_path!r} does not exist; give a local model directory or a hub id")
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except OSError as err:
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is neither a local model directory nor a cached hub model "
            f"({type(err).__name__})"
        ) from None
    if config.model_type not in ADAPTERS:
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is a {config.model_type!r} model; supported model types: "
            f"{', '.join(sorted(ADAPTERS))}"
        )
    if len(tokenizer) > config.vocab_size:  # checked on the config, before any weights are read
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but model {name_or_path!r} has a vocabulary of "
            f"{config.vocab_size}; use the model's own tokenizer"
        )
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(name_or_path, attn_implementation=attn_implementation)
