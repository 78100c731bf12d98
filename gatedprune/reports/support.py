"""Which transformers encoder-decoder classes gatedprune supports, decided by running the checks on tiny models.

``tiny_config`` shrinks a class's default config by one generic rule (field names, not families); ``check_class``
runs on it what the family tests check. ``scripts/support_table.py`` writes the README's table from the results.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)

from gatedprune.structures.adapters import ATTENTION_KINDS, LayoutError, attention_sites, probe
from gatedprune.shipping.export import save_pruned
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.masking import masked_heads
from gatedprune.surgery.cut import count_parameters, prune_heads, removed_parameters
from gatedprune.surgery.model_loading import auto_class, load_pruned

TINY = {"hidden": 32, "head_dim": 8, "heads": 4, "kv_heads": 2, "ffn": 48, "layers": 2, "vocab": 128}


def _tiny_value(name: str, value: int, fields: dict) -> int:
    """The tiny value of one integer config field, by its name alone."""
    if name in ("vocab_size",) or name.endswith("_vocab_size"):
        return min(value, TINY["vocab"])
    if "key_value_heads" in name:  # keep grouped-query attention grouped, and multi-head attention not
        heads = next((v for k, v in fields.items() if k.endswith("attention_heads") and isinstance(v, int)), value)
        return TINY["kv_heads"] if value < heads else TINY["heads"]
    if name.endswith("heads") and "attention" in name or name in ("num_heads", "n_head", "n_heads"):
        return min(value, TINY["heads"])
    if (name.endswith("layers") and not any(w in name for w in ("conv", "feat", "extract"))) or name == "n_layer":
        return min(value, TINY["layers"])
    if name in ("head_dim", "d_kv", "attention_head_dim") or name.endswith("_head_dim"):
        return min(value, TINY["head_dim"])
    if name in ("d_model", "hidden_size", "embed_dim", "n_embd") or name.endswith(("_hidden_size", "_d_model", "_embed_dim")):
        return min(value, TINY["hidden"])
    if name in ("d_ff", "intermediate_size") or name.endswith(("ffn_dim", "_intermediate_size", "_ffn_dim")):
        return min(value, TINY["ffn"])
    return value


def tiny_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """``config`` (and every sub-config) shrunk in place: 2 layers, 4 heads (2 key/value heads where grouped),
    width 32, head size 8, FFN 48, vocabulary at most 128 (special token ids moved inside it); no dropout."""
    fields = config.to_diff_dict() | {k: v for k, v in vars(config).items() if not k.startswith("_")}
    depth = {}  # layer counts: old -> new, for per-layer lists such as layer_types
    for name, value in fields.items():
        if isinstance(value, transformers.PretrainedConfig):
            tiny_config(value)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            setattr(config, name, _tiny_value(name, value, fields))
            if "layers" in name and getattr(config, name) != value:
                depth[value] = getattr(config, name)
        elif isinstance(value, float) and "dropout" in name:
            setattr(config, name, 0.0)
    for name, value in fields.items():
        if isinstance(value, (list, tuple)) and "layer" in name and len(value) in depth:
            setattr(config, name, type(value)(value[: depth[len(value)]]))
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        # generation needs one: bos, else pad (T5's convention), of the config or else of its decoder's
        text = config.get_text_config(decoder=True)
        candidates = [getattr(c, f"{t}_token_id", None) for t in ("bos", "pad") for c in (config, text)]
        config.decoder_start_token_id = next((t for t in candidates if isinstance(t, int)), None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for name, value in fields.items():
            if name.endswith("token_id") and isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
                setattr(config, name, vocab - 1 - len(name) % 8)  # inside the vocabulary, distinct for the usual few
    return config


def all_classes() -> list[tuple[str, type]]:
    """(model_type, class) of every class of both mappings, once each, sorted by model_type."""
    pairs = set()
    for mapping in (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES):
        pairs.update(mapping.items())
    return [(model_type, getattr(transformers, name)) for model_type, name in sorted(pairs)]


# --- the checks ----------------------------------------------------------------------------------------------

ATOL = 1e-5  # surgery vs masking, float32
# kept heads per kind and layer, for 4 query heads: some kept, all kept, one, none, and (2 key/value heads) a
# group with one of its two query heads, so grouped attention needs a filler
PLAN = {"encoder": ([0, 2], [1, 2, 3]), "decoder": ([0, 1, 2, 3], [3]), "cross": ([1], [])}


class NotSupported(Exception):
    """A class fails a check; the message is the one-line reason the support table gives."""


def build_tiny(cls: type, seed: int = 0, attn_implementation: str | None = None) -> nn.Module:
    """A random tiny model of ``cls`` (see ``tiny_config``), float32, eval mode; attention as the class prefers."""
    config = tiny_config(cls.config_class())
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()


def tiny_inputs(model: nn.Module, batch: int = 2, source: int = 7, target: int = 5) -> dict[str, torch.Tensor]:
    """Random encoder inputs of the model's own kind (token ids, or features its own feature extractor computes
    from random audio) and decoder input ids; the second sequence padded where the input is token ids."""
    generator = torch.Generator().manual_seed(0)
    config = model.config
    vocab = config.get_text_config(decoder=True).vocab_size
    name = model.main_input_name
    if name == "input_ids":
        input_ids = torch.randint(3, vocab - 2, (batch, source), generator=generator)  # (B, S)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, source - 2 :] = 0
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    else:
        # the feature extractor of the model's own config, or of its encoder's (SpeechEncoderDecoderModel)
        owner = next(c for c in (config, getattr(config, "encoder", None)) if type(c) in FEATURE_EXTRACTOR_MAPPING)
        extractor = FEATURE_EXTRACTOR_MAPPING[type(owner)]()
        audio = torch.rand(batch, extractor.sampling_rate // 4, generator=generator).numpy() - 0.5  # 1/4 s
        features = extractor(list(audio), sampling_rate=extractor.sampling_rate, return_tensors="pt")
        inputs = {name: features[extractor.model_input_names[0]].float()}
    decoder_input_ids = torch.randint(3, vocab - 2, (batch, target), generator=generator)  # (B, T)
    start = model.generation_config.decoder_start_token_id
    if isinstance(start, int):
        decoder_input_ids[:, 0] = start
    return {**inputs, "decoder_input_ids": decoder_input_ids}


@torch.no_grad()
def logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).logits  # (B, T, V)


@torch.no_grad()
def greedy(model: nn.Module, inputs: dict, max_new_tokens: int = 6) -> torch.Tensor:
    """Greedy generation with the KV cache (the default)."""
    encoder_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    return model.generate(**encoder_inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, num_beams=1)


def _error(error: Exception, limit: int = 120) -> str:
    """``Type: first line of the message`` (just ``Type`` when the message is empty)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


def _check(condition: bool, reason: str) -> None:
    if not condition:
        raise NotSupported(reason)


def check_gates(cls: type) -> None:
    """Open gates change nothing; closing the gates of one key/value group equals zeroing its value rows."""
    model = build_tiny(cls)
    inputs = tiny_inputs(model)
    reference = logits(model, inputs)
    gates = attach_gates(model, init_log_alpha=5.0)  # deterministic gate exactly 1
    _check(torch.equal(logits(model, inputs), reference), "open gates change the logits")
    gates.remove()
    sites = attention_sites(model)
    for kind in ATTENTION_KINDS:
        index = next(i for i, s in enumerate(sites) if s.kind == kind and s.layer == 1)
        site = sites[index]
        group = site.num_heads // site.num_kv_heads
        zeroed = build_tiny(cls)
        v = attention_sites(zeroed)[index].projection("v")
        rows = slice(1 * site.head_dim, 2 * site.head_dim)  # key/value head 1
        with torch.no_grad():
            v.weight[rows] = 0
            if v.bias is not None:
                v.bias[rows] = 0
        expected = logits(zeroed, inputs)
        gates = attach_gates(model, init_log_alpha=5.0).set_mode("deterministic")
        with torch.no_grad():
            gates.gates[index].log_alpha[group : 2 * group] = -5.0  # its query heads: deterministic gate exactly 0
        gated = logits(model, inputs)
        gates.remove()
        error, effect = (gated - expected).abs().max(), (reference - expected).abs().max()
        _check(error < 1e-6 and effect > 100 * error,
               f"a closed {kind} gate is not the head's value rows zeroed (error {error:.2g}, effect {effect:.2g})")


def check_surgery(cls: type, plan_of, directory: Path) -> None:
    """``prune_heads`` equals masking (logits, greedy generation with cache, parameter count), and both reload
    paths give the pruned model's logits and generations."""
    model = build_tiny(cls)
    inputs = tiny_inputs(model)
    plan = {s.path: plan_of(s) for s in attention_sites(model)}
    with masked_heads(model, plan):
        expected, expected_tokens = logits(model, inputs), greedy(model, inputs)
    before, removed = count_parameters(model), removed_parameters(model, plan)
    prune_heads(model, plan)
    error = (logits(model, inputs) - expected).abs().max()
    _check(error < ATOL, f"pruned logits differ from masked ones by {error:.2g}")
    tokens = greedy(model, inputs)
    _check(torch.equal(tokens, expected_tokens), "pruned greedy generation differs from masked")
    _check(count_parameters(model) == before - removed,
           f"parameters {count_parameters(model)}, expected {before} - {removed}")
    save_pruned(model, directory)
    reloaded = {
        "load_pruned": load_pruned(directory),
        "trust_remote_code": auto_class(model.config).from_pretrained(directory, trust_remote_code=True),
    }
    for way, again in reloaded.items():
        again.eval()
        _check(torch.equal(logits(again, inputs), logits(model, inputs)), f"{way} reload changes the logits")
        _check(torch.equal(greedy(again, inputs), tokens), f"{way} reload changes greedy generation")


def check_class(cls: type, directory: Path) -> str:
    """The layout of ``cls`` (as the support table writes it); raises ``NotSupported`` with the reason."""
    try:
        model = build_tiny(cls)
    except Exception as error:  # noqa: BLE001  (any failure here is the shrinking rule's, reported as such)
        raise NotSupported(
            f"not checked: its default config shrunk by the generic rule does not build ({_error(error)})"
        ) from error
    try:
        structure = probe(model)
    except LayoutError as error:
        raise NotSupported(error.short) from error
    try:  # the untouched model on the generic inputs: a failure here is the checks', not gatedprune's
        inputs = tiny_inputs(model)
        logits(model, inputs), greedy(model, inputs)
    except Exception as error:  # noqa: BLE001
        raise NotSupported(f"not checked: the generic tiny inputs do not fit this class ({_error(error)})") from error
    steps = {
        "gates": lambda: check_gates(cls),
        "surgery": lambda: check_surgery(cls, lambda s: PLAN[s.kind][s.layer], directory / "some"),
        "surgery, every head removed": lambda: check_surgery(cls, lambda s: [], directory / "none"),
    }
    for step, check in steps.items():
        try:
            check()
        except NotSupported:
            raise
        except Exception as error:  # noqa: BLE001  (the class computes or loads wrong once gated or cut)
            raise NotSupported(f"{step} fails: {_error(error, 160)}") from error
    return structure.describe()
