"""Tiny random configs of every supported family, saved and loaded by path like a hub id."""

from __future__ import annotations

import transformers

from gatedprune.reports.support import tiny_config

_COMMON_BART = dict(
    vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0,
)

FAMILY_CONFIGS = {
    "bart": lambda: transformers.BartConfig(**_COMMON_BART),
    "mbart": lambda: transformers.MBartConfig(**_COMMON_BART),
    "marian": lambda: transformers.MarianConfig(**{**_COMMON_BART, "pad_token_id": 98, "decoder_start_token_id": 98}),
    "pegasus": lambda: transformers.PegasusConfig(**{**_COMMON_BART, "pad_token_id": 0, "decoder_start_token_id": 0}),
    "m2m_100": lambda: transformers.M2M100Config(**_COMMON_BART),
    "t5": lambda: transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    ),
    # the variants: a position bias owned by every layer, and grouped key/value heads (4 query heads, 2 k/v heads);
    # their tiny configs come from the generic shrinking rule of the support table
    "mt5": lambda: tiny_config(transformers.MT5Config()),
    "umt5": lambda: tiny_config(transformers.UMT5Config()),
    "t5gemma": lambda: tiny_config(transformers.T5GemmaConfig()),
}
FAMILIES = sorted(FAMILY_CONFIGS)
# attention implementations each family has in transformers (T5Gemma: eager only, for its logit soft-capping)
ATTN_IMPLEMENTATIONS = {family: ("eager",) if family == "t5gemma" else ("sdpa", "eager") for family in FAMILIES}


def tiny_model(family: str, tmp_path, attn_implementation: str | None = None, seed: int = 0):
    """A random tiny model of ``family``, saved to ``tmp_path`` and loaded back by path (sdpa where it has it)."""
    import torch

    attn_implementation = attn_implementation or ATTN_IMPLEMENTATIONS[family][0]
    torch.manual_seed(seed)
    model = transformers.AutoModelForSeq2SeqLM.from_config(FAMILY_CONFIGS[family]())
    path = tmp_path / family
    model.save_pretrained(path)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path, attn_implementation=attn_implementation)
    return model.eval()


def save_plain_mbart(path, tokenizer, width: int, seed: int = 0) -> None:
    """A tiny random mBART sized to ``tokenizer`` (1+1 layers, 2 heads, d_model and FFN ``width``, 128 positions),
    saved with ``save_pretrained`` beside its tokenizer: a model directory gatedprune did not write."""
    import torch

    torch.manual_seed(seed)
    config = transformers.MBartConfig(
        vocab_size=len(tokenizer), d_model=width, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=width, decoder_ffn_dim=width, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=None, max_position_embeddings=128,
    )
    transformers.MBartForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
