"""Loading models: the family class of a config, a pretrained model or one built from a config (sized to the
tokenizer), a pruned export with its cut shapes (``load_pruned``), and either of those from a directory
(``load_seq2seq``)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
)

from gatedprune.structures.adapters import PIN_KEY, pin_layout, probe
from gatedprune.surgery.pruned_modeling import CONFIG_KEY, pruned_model_class


# the encoder-decoder mappings of transformers, text first (seamless_m4t is in both), and their Auto classes
ENCODER_DECODER_MAPPINGS = (
    (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, transformers.AutoModelForSeq2SeqLM),
    (MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING, transformers.AutoModelForSpeechSeq2Seq),
)


def _mapping_entry(config: transformers.PretrainedConfig) -> tuple[type, type]:
    for mapping, auto in ENCODER_DECODER_MAPPINGS:
        if type(config) in mapping:
            return mapping[type(config)], auto
    raise ValueError(
        f"unsupported model class: a {config.model_type!r} config has no encoder-decoder class in transformers "
        "(neither AutoModelForSeq2SeqLM nor AutoModelForSpeechSeq2Seq maps it)"
    )


def family_class(config: transformers.PretrainedConfig) -> type:
    """The transformers encoder-decoder class of ``config`` (e.g. ``MarianMTModel`` for a MarianConfig, or
    ``WhisperForConditionalGeneration``)."""
    return _mapping_entry(config)[0]


def auto_class(config: transformers.PretrainedConfig) -> type:
    """``AutoModelForSeq2SeqLM``, or ``AutoModelForSpeechSeq2Seq`` for a speech model (Whisper)."""
    return _mapping_entry(config)[1]


def fresh_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """A newly initialised model of ``config``'s family, cut to the shapes of its plan if it has one."""
    base = family_class(config)
    model = pruned_model_class(base)(config)
    model.__class__ = base  # see load_pruned
    return model


def load_pruned(path: str | Path, **from_pretrained_kwargs) -> transformers.PreTrainedModel:
    """Load a model saved after ``prune_heads`` (by ``save_pretrained`` or the exporter) with its pruned shapes.

    Returns an instance of the family's own class (e.g. ``MarianMTModel``); keyword arguments go to
    ``from_pretrained`` (``dtype``, ``device_map``, ``attn_implementation``, ...).
    """
    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, CONFIG_KEY, None) is None:
        raise ValueError(
            f"{path} holds no head plan (its config has no {CONFIG_KEY!r} entry): it was not saved after "
            "gatedprune.prune_heads; load it with AutoModelForSeq2SeqLM.from_pretrained"
        )
    base = family_class(config)
    model = pruned_model_class(base).from_pretrained(path, config=config, **from_pretrained_kwargs)
    # the subclass only adds the shape restore to the constructor; once built, the model is an ordinary `base`
    model.__class__ = base
    return model


def load_seq2seq(model_dir: str | Path):
    """A pruned export (``load_pruned``) or any Hugging Face seq2seq model (directory or cached hub id);
    ``ValueError`` for anything else."""
    path = Path(model_dir)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")
    try:  # a local directory, or a hub id already in the cache (nothing is downloaded offline)
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except OSError:
        raise ValueError(f"{model_dir} is neither a model directory nor a cached hub model") from None
    if getattr(config, CONFIG_KEY, None) is not None:
        return load_pruned(model_dir)
    if type(config) not in transformers.AutoModelForSeq2SeqLM._model_mapping:
        raise ValueError(f"{model_dir} holds a {config.model_type!r} model, not a sequence-to-sequence one")
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(model_dir)


def check_layout(config: transformers.PretrainedConfig, layout: str | dict | None = None) -> None:
    """Refuse, before any weight is loaded, a config whose model gatedprune cannot find the attention heads of.

    Builds the model on the meta device (no memory, no weights) and probes its structure; ``layout`` pins one.
    """
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
    (see ``gatedprune.structures.adapters.pin_layout``); it is kept on the model's config.
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
