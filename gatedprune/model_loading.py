"""Load a pretrained seq2seq model, or build one from a config, sized to the tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gatedprune.adapters import PIN_KEY, pin_layout, probe


def check_layout(config: transformers.PretrainedConfig, layout: str | dict | None = None) -> None:
    """Refuse, before any weight is loaded, a config whose model gatedprune cannot find the attention heads of.

    Builds the model on the meta device (no memory, no weights) and probes its structure; ``layout`` pins one.
    """
    from gatedprune.surgery import family_class  # surgery imports the training-free half of gatedprune only

    with torch.device("meta"):
        model = family_class(config)(config)
    if layout is not None:
        pin_layout(model, layout)
    probe(model)


def load_model(
    tokenizer: PreTrainedTokenizerBase,
    name_or_path: str | None = None,
    from_scratch: dict | None = None,
    attn_implementation: str = "sdpa",
    layout: str | dict | None = None,
) -> PreTrainedModel:
    """A supported seq2seq model: ``name_or_path`` (hub id or local dir) or, if that is None, a fresh one.

    ``from_scratch`` holds the config fields of the new model, ``model_type`` included (e.g. mbart, d_model,
    encoder_layers, ...). Vocabulary size and special token ids come from ``tokenizer``; the decoder starts
    with EOS, as mBART's label shift does. ``layout`` pins the attention layout for a model the probe cannot decide
    (see ``gatedprune.adapters.pin_layout``); it is kept on the model's config.
    """
    if name_or_path is not None:
        model = _load_pretrained(str(name_or_path), tokenizer, attn_implementation, layout)
    else:
        model = _from_scratch(tokenizer, from_scratch, attn_implementation, layout)
    if layout is not None:
        pin_layout(model, layout)
    start_with_target_language(model, tokenizer)
    return model


def start_with_target_language(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Generate targets framed as the tokenizer frames them when it has a target language code (``tgt_lang``).

    Read off the tokenizer's own behaviour, not its family: a code it puts first in targets (mBART-50, M2M100,
    NLLB) is forced as the first generated token; a code it puts last (mBART-cc25: the label shift moves it to the
    front) starts the decoder.
    """
    code = getattr(tokenizer, "tgt_lang", None)
    if not isinstance(code, str) or code not in tokenizer.get_vocab():
        return
    code_id = tokenizer.convert_tokens_to_ids(code)
    target = tokenizer(text_target="a")["input_ids"]
    if target[0] == code_id:
        model.generation_config.forced_bos_token_id = code_id
    elif target[-1] == code_id:
        model.generation_config.decoder_start_token_id = code_id


def _from_scratch(tokenizer, from_scratch: dict | None, attn_implementation: str, layout) -> PreTrainedModel:
    if not from_scratch or "model_type" not in from_scratch:
        raise ValueError("model: set model.name_or_path (hub id or local directory) or model.from_scratch.model_type")
    fields = dict(from_scratch)
    model_type = fields.pop("model_type")
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
    check_layout(config, layout)
    return transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attn_implementation)


def _load_pretrained(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, attn_implementation: str, layout
) -> PreTrainedModel:
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
    try:
        check_layout(config, layout if layout is not None else getattr(config, PIN_KEY, None))
    except ValueError as err:
        raise ValueError(f"model.name_or_path={name_or_path!r} ({config.model_type}): {err}") from None
    if len(tokenizer) > config.vocab_size:  # checked on the config, before any weights are read
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but model {name_or_path!r} has a vocabulary of "
            f"{config.vocab_size}; use the model's own tokenizer"
        )
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(name_or_path, attn_implementation=attn_implementation)
