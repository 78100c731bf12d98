"""``hf-portable``: a pruned model written as the stock transformers class and config, read without
``trust_remote_code`` by every tool that reads Hugging Face models (the stock CTranslate2 converter included).

The stock classes take their shapes from a few config counts, so only plans those counts can say are written:

- BART-like families derive ``head_dim = d_model / heads``: no attention module may lose a head; one FFN width per
  stack (``encoder_ffn_dim``, ``decoder_ffn_dim``); any number of layers.
- T5 and mT5 have an explicit ``d_kv``, but one ``num_heads`` and one ``d_ff`` for every layer of both stacks; and
  the relative position bias, computed once in the first block of a stack and handed on, has one column per head,
  so every self-attention layer of a stack keeps the same heads (the table's columns are cut to them once).

Anything else is refused, in one line naming the uneven shape. Nothing about the plan travels: the directory is
what ``save_pretrained`` of a model that was built that small would write.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from gatedprune.deploy.verify import DeployError, compare_tokens, describe_difference, greedy_reference
from gatedprune.structures.adapters import attention_sites, probe
from gatedprune.structures.kinds import ALL_KINDS, KINDS, STACKS
from gatedprune.surgery.pruned_modeling import CONFIG_KEY
from gatedprune.surgery.record import current_record, model_ffn_sites

NAME = "hf-portable"
LOGIT_TOLERANCE = 1e-4  # float32, the same arithmetic in both models: differences are summation order only
ANY_SHAPES = "use --format ct2 or onnx, which take any shapes"


@dataclass(frozen=True)
class Family:
    """Where a stock config counts what pruning changes, per stack (encoder, decoder); one name for both stacks
    means one count for both."""

    heads: tuple[str, str]  # counts the heads of the stack's attention modules (the decoder's: self and cross)
    ffn: tuple[str, str]  # the FFN width of every layer of the stack
    layers: tuple[str, str]
    head_dim: str | None  # an explicit head size; None: derived as d_model / heads, so no head can go
    normalize_before: bool | None = None  # written for the stock CTranslate2 converter (BartLoader reads it)


_BART = dict(heads=("encoder_attention_heads", "decoder_attention_heads"), ffn=("encoder_ffn_dim", "decoder_ffn_dim"),
             layers=("encoder_layers", "decoder_layers"), head_dim=None)
_T5 = dict(heads=("num_heads", "num_heads"), ffn=("d_ff", "d_ff"), layers=("num_layers", "num_decoder_layers"),
           head_dim="d_kv")
FAMILY_TABLE = {
    "bart": Family(**_BART, normalize_before=False),  # post-norm
    "mbart": Family(**_BART, normalize_before=True),  # pre-norm
    "marian": Family(**_BART, normalize_before=False),
    "m2m_100": Family(**_BART, normalize_before=True),
    "t5": Family(**_T5),
    "mt5": Family(**_T5),
}
FAMILIES = tuple(FAMILY_TABLE)


def _config_name(model: nn.Module) -> str:
    return type(model.config).__name__


def _counts(items) -> str:
    return ", ".join(str(n) for n in items)


def _grouped(sites, field_of, size) -> dict[str, dict[str, list[int]]]:
    """``{config field: {kind: [size of each site of the kind, by layer]}}``."""
    grouped: dict[str, dict[str, list[int]]] = {}
    for site in sorted(sites, key=lambda s: (ALL_KINDS.index(s.kind), s.layer)):
        grouped.setdefault(field_of(site), {}).setdefault(site.kind, []).append(size(site))
    return grouped


def _stack_field(fields: tuple[str, str]):
    return lambda site: fields[STACKS.index(KINDS[site.kind].stack)]


def _check_empty(model: nn.Module) -> None:
    for site in attention_sites(model):
        if site.num_heads == 0:
            raise ValueError(f"{NAME}: the {KINDS[site.kind].title} of layer {site.layer} has no heads left; the stock "
                             f"{_config_name(model)} has no attention without heads; {ANY_SHAPES}")
    for site in model_ffn_sites(model):
        if site.width == 0:
            raise ValueError(f"{NAME}: the {KINDS[site.kind].stack} FFN of layer {site.layer} has no units left; an "
                             f"FFN of width 0 is not written as a stock {_config_name(model)} (ct2 pads it with one "
                             f"zero unit); {ANY_SHAPES}")


def _check_heads(model: nn.Module, family: Family, record: dict) -> None:
    sites = attention_sites(model)
    if family.head_dim is None:  # head_dim = d_model / heads: a smaller count would mean wider heads
        for site in sites:
            if site.num_heads != record["num_heads"][site.path]:
                raise ValueError(
                    f"{NAME}: heads were removed from the {KINDS[site.kind].title} of layer {site.layer} (it keeps "
                    f"{site.num_heads} of {record['num_heads'][site.path]}); the stock {_config_name(model)} derives "
                    f"head_dim = d_model / heads, so every attention module keeps all its heads; {ANY_SHAPES}")
        return
    for field, per_kind in _grouped(sites, _stack_field(family.heads), lambda s: s.num_heads).items():
        if len({n for counts in per_kind.values() for n in counts}) > 1:
            shown = "; ".join(f"{KINDS[kind].title} {_counts(counts)}" for kind, counts in per_kind.items())
            raise ValueError(f"{NAME}: attention head counts differ ({shown}); the stock {_config_name(model)} has "
                             f"one {field} for every attention module, self and cross, so every module keeps the "
                             f"same count (pruning.uniform_heads=true gives one per kind, not one for all, nor the "
                             f"same heads in every layer); {ANY_SHAPES}")
    for stack in STACKS:  # the shared position bias: one column per head, for every self-attention layer
        if record["layout"].get(stack, {}).get("position_bias") != "shared":
            continue
        kept = {site.layer: record["slots"][site.path] for site in sites if site.kind == stack}
        if len({tuple(heads) for heads in kept.values()}) > 1:
            shown = ", ".join(f"{heads} in layer {layer}" for layer, heads in sorted(kept.items()))
            raise ValueError(f"{NAME}: the {KINDS[stack].title} layers keep different heads ({shown}); the stock "
                             f"{_config_name(model)} shares one position bias per stack, so every layer keeps the "
                             f"same heads; {ANY_SHAPES}")


def _check_ffn(model: nn.Module, family: Family) -> None:
    for field, per_kind in _grouped(model_ffn_sites(model), _stack_field(family.ffn), lambda s: s.width).items():
        if len({n for widths in per_kind.values() for n in widths}) <= 1:
            continue
        uneven = [kind for kind, widths in per_kind.items() if len(set(widths)) > 1]
        if uneven:  # within a stack: the export rule that keeps one width per stack fixes it
            widths = per_kind[uneven[0]]
            both = "" if family.ffn[0] != family.ffn[1] else ", for both stacks"  # one name: one width for both
            hint = ("prune with pruning.uniform_ffn=true" if not both else
                    f"pruning.uniform_ffn=true gives one width per stack, not one for both; {ANY_SHAPES}")
            raise ValueError(f"{NAME}: {KINDS[uneven[0]].stack} FFN widths differ by layer ({_counts(widths)}); the "
                             f"stock {_config_name(model)} has one {field}{both}; {hint}")
        shown = "; ".join(f"{KINDS[kind].stack} {widths[0]}" for kind, widths in per_kind.items())
        raise ValueError(f"{NAME}: FFN widths differ between the stacks ({shown}); the stock {_config_name(model)} "
                         f"has one {field} for both; {ANY_SHAPES}")


def _check_cache(model: nn.Module) -> None:
    """The cache ``generate()`` builds from the stock config must hold every decoder layer. Legacy flat configs
    (T5) count it by ``num_hidden_layers``, which is the encoder's depth: asked of the installed transformers, not
    assumed, so a version that counts the decoder's lets such plans through."""
    config = stock_config(model)
    path = probe(model).layers.get("decoder")
    decoder = len(model.get_submodule(path)) if path else 0
    cached = len(transformers.DynamicCache(config=config).layers)  # 0: layers made as they are used
    if 0 < cached < decoder:
        counted_by = config.attribute_map.get("num_hidden_layers", "num_hidden_layers")
        raise ValueError(f"{NAME}: the decoder keeps {decoder} layers but transformers {transformers.__version__} "
                         f"sizes the stock {_config_name(model)}'s generation cache to {cached} (its {counted_by}), "
                         f"so generate() fails; keep at least as many encoder layers as "
                         f"decoder layers or {ANY_SHAPES}")


def check(model: nn.Module, **options) -> None:
    """Refuse, in one line, a model whose shapes the stock class of its family cannot hold."""
    family = FAMILY_TABLE[model.config.model_type]
    _check_empty(model)
    _check_heads(model, family, current_record(model))
    _check_ffn(model, family)
    _check_cache(model)


def stock_config(model: nn.Module) -> transformers.PretrainedConfig:
    """The model's config without the plan and the remote-code map, its counts those of the pruned shapes."""
    family = FAMILY_TABLE[model.config.model_type]
    values = model.config.to_dict()
    for key in (CONFIG_KEY, "auto_map", "architectures"):
        values.pop(key, None)
    config = type(model.config).from_dict(values)
    structure = probe(model)
    for stack, field in zip(STACKS, family.layers):
        path = structure.layers.get(stack)
        setattr(config, field, len(model.get_submodule(path)) if path else 0)
    for fields, size, sites in ((family.heads, lambda s: s.num_heads, attention_sites(model)),
                                (family.ffn, lambda s: s.width, model_ffn_sites(model))):
        for field, per_kind in _grouped(sites, _stack_field(fields), size).items():
            setattr(config, field, next(iter(per_kind.values()))[0])  # check() made them all equal
    return config


def stock_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The pruned model's weights, named as the stock class names them: the same, but for a shared position bias,
    which the pruned runtime keeps whole (each module picks its heads of it) and the stock class holds cut."""
    state = model.state_dict()
    record = current_record(model)
    for stack, described in record["layout"].items():
        if described.get("position_bias") != "shared":
            continue
        sites = [s for s in attention_sites(model) if s.kind == stack]
        key = f"{described['layers']}.0.{described['self_attention']}.{described['position_bias_attr']}.weight"
        if sites and key in state:
            heads = torch.as_tensor(record["slots"][sites[0].path], dtype=torch.long)
            state[key] = state[key][:, heads.to(state[key].device)]  # (buckets, H) -> (buckets, H')
    return state


def _stock_model(model: nn.Module, config: transformers.PretrainedConfig) -> nn.Module:
    stock = transformers.AutoModelForSeq2SeqLM.from_config(config)
    try:
        stock.load_state_dict(stock_state(model), strict=True)
    except RuntimeError as err:  # shapes or names the stock class does not have: a gap in check()
        raise DeployError(f"{NAME}: the stock {type(stock).__name__} does not take this model's weights: "
                          f"{str(err).splitlines()[-1].strip()}") from err
    stock.generation_config = copy.deepcopy(model.generation_config)
    return stock.eval()


@torch.no_grad()
def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(**{name: value.to(device) for name, value in batch.items()}).logits.float().cpu()  # (B, T, V)


def write(model: nn.Module, stage: Path, *, tokenizer=None, batch: dict, max_new_tokens: int, **options) -> dict:
    """Write ``model`` into ``stage`` as its stock class and check that a plain ``from_pretrained`` of it gives the
    model's logits and greedy tokens."""
    family = FAMILY_TABLE[model.config.model_type]
    stock = _stock_model(model, stock_config(model))
    stock.save_pretrained(stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    if family.normalize_before is not None:  # in the file only: transformers v5 configs no longer have the field
        config_file = Path(stage) / "config.json"
        values = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**values, "normalize_before": family.normalize_before}, indent=2,
                                          sort_keys=True) + "\n")
    device = next(model.parameters()).device
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(stage).to(device).eval()  # no trust_remote_code
    if not type(again).__module__.startswith("transformers."):
        raise DeployError(f"{NAME}: {stage} reloads as {type(again).__name__}, not a stock transformers class")
    diff = float((_logits(again, batch) - _logits(model, batch)).abs().max())
    if not diff < LOGIT_TOLERANCE:
        raise DeployError(f"{NAME}: the stock {type(again).__name__} reloaded from the directory gives logits up to "
                          f"{diff:.3g} away from the pruned model's (tolerance {LOGIT_TOLERANCE:g})")
    tokens = compare_tokens("stock", greedy_reference(again, batch, max_new_tokens),
                            greedy_reference(model, batch, max_new_tokens))
    if not tokens["greedy_identical"]:
        raise DeployError(f"{NAME}: {describe_difference('stock', tokens)}")
    counts = {field: getattr(again.config, field) for field in
              dict.fromkeys((*family.layers, *family.heads, *family.ffn))}
    return {
        "stock_class": type(again).__name__,
        "config": {**counts, **({"normalize_before": family.normalize_before}
                                if family.normalize_before is not None else {})},
        "parameters": sum(p.numel() for p in again.parameters()),
        "verification": {"max_abs_logit_diff": diff, "logit_tolerance": LOGIT_TOLERANCE, **tokens, "passed": True},
    }
