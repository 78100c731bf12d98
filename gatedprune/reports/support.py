"""Which transformers encoder-decoder classes gatedprune supports, decided by running the checks on tiny models.

``tiny_config`` shrinks a class's default config by one generic rule (field names, not families); ``check_class``
runs on it what the family tests check for attention heads, ``check_kinds`` the same for each kind of structure
(heads, FFN units, layers). ``scripts/support_table.py`` writes the support table (docs/guide/models.md) from the results.
"""

from __future__ import annotations

from collections.abc import Callable
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
from gatedprune.structures.ffn import FFNError
from gatedprune.structures.head_gates import attach_gates
from gatedprune.structures.kinds import FFN_KINDS, STACKS, ffn_kind, layer_kind
from gatedprune.structures.masking import masked_heads
from gatedprune.structures.sites import structure_sites
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
# kept layers per stack, for 2 layers: the first layer of one stack dropped and the last of the other, so a
# position bias owned by a first layer moves and the indices of what follows a dropped layer are renumbered
LAYER_PLANS = ({"encoder": [1], "decoder": [0]}, {"encoder": [0], "decoder": [1]})
# the groups of kinds the support table has a column for
GROUPS = {"heads": "attention heads", "ffn": "FFN units", "layers": "layers"}


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


def _other_parameters(again: nn.Module, model: nn.Module) -> str:
    """Why a reload may compute otherwise: the first parameter names it has that the pruned model lacks, or
    lacks that it has (a module the config builds other than the one kept)."""
    ours, theirs = set(model.state_dict()), set(again.state_dict())
    said = [f"{what} {min(names)}{', ...' if len(names) > 1 else ''}"
            for what, names in (("has", theirs - ours), ("lacks", ours - theirs)) if names]
    return f" (it {' and '.join(said)})" if said else ""


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


def check_surgery(cls: type, plan_of, directory: Path, kinds=ATTENTION_KINDS) -> None:
    """``check_plan_surgery`` of the plan that keeps ``plan_of(site)`` of every site of ``kinds``."""
    check_plan_surgery(cls, lambda model: {s.path: plan_of(s) for s in structure_sites(model, kinds)}, directory)


def check_plan_surgery(cls: type, plan_for: Callable[[nn.Module], dict], directory: Path) -> None:
    """``prune_heads`` with the plan ``plan_for(model)`` equals masking (logits, greedy generation with cache,
    parameter count), and both reload paths give the pruned model's logits, generations and parameter count."""
    model = build_tiny(cls)
    inputs = tiny_inputs(model)
    plan = plan_for(model)
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
        _check(torch.equal(logits(again, inputs), logits(model, inputs)),
               f"{way} reload changes the logits{_other_parameters(again, model)}")
        _check(torch.equal(greedy(again, inputs), tokens), f"{way} reload changes greedy generation")
        _check(count_parameters(again) == count_parameters(model),
               f"{way} reload has {count_parameters(again)} parameters, the pruned model {count_parameters(model)}")


# an FFN's input projection whose rows, zeroed, switch its units off whatever the activation (act(0) = 0, or the
# linear half of a gated block); found by these names, not through gatedprune's layout table, to check it
FFN_INPUTS = ("fc1", "wi", "wi_1", "up_proj", "intermediate.dense")


def _ffn_input(model: nn.Module, stack: str, layer: int) -> nn.Linear:
    block = model.get_submodule(probe(model).layers[stack])[layer]
    found = [m for n, m in block.named_modules() if isinstance(m, nn.Linear)
             and any(n == name or n.endswith(f".{name}") for name in FFN_INPUTS)]
    _check(len(found) == 1, f"{stack} layer {layer} has {len(found)} FFN input projections named "
                            f"{'/'.join(FFN_INPUTS)}, so a closed unit gate has no reference (one is needed)")
    return found[0]


def _closed_gate_is(reference: torch.Tensor, gated: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error, effect = (gated - expected).abs().max(), (reference - expected).abs().max()
    _check(error < 1e-6 and effect > 100 * error, f"a closed {what} (error {error:.2g}, effect {effect:.2g})")


def check_unit_gates(cls: type) -> None:
    """Per stack: open unit gates change nothing; closing every odd unit of the last layer equals zeroing their
    rows of its FFN input projection (half the units: a few could all be dead under ReLU on the tiny inputs, as
    units 1 and 3 of Speech2Text's are). A mixture of experts, or no FFN of a known layout: refused in one line."""
    for stack in STACKS:
        model = build_tiny(cls)
        inputs = tiny_inputs(model)
        reference = logits(model, inputs)
        try:
            gates = attach_gates(model, [ffn_kind(stack)], init_log_alpha=5.0).set_mode("deterministic")
        except FFNError as error:  # the one-line refusal, less the kind and class it starts with
            raise NotSupported(str(error).partition(": ")[2].partition("; allowed")[0]) from error
        _check(torch.equal(logits(model, inputs), reference), f"open {stack} unit gates change the logits")
        last = len(gates.gates) - 1
        closed = list(range(1, gates.gates[last].num_heads, 2))
        with torch.no_grad():
            gates.gates[last].log_alpha[closed] = -5.0  # deterministic gate exactly 0
        gated = logits(model, inputs)
        gates.remove()
        zeroed = build_tiny(cls)
        projection = _ffn_input(zeroed, stack, gates.layers[last])
        with torch.no_grad():
            projection.weight[closed] = 0
            if projection.bias is not None:
                projection.bias[closed] = 0
        _closed_gate_is(reference, gated, logits(zeroed, inputs), f"{stack} unit gate is not its input rows zeroed")


def check_layer_gates(cls: type) -> None:
    """Per stack: open layer gates change nothing; closing the last layer's gate equals deleting that layer from
    its ModuleList. Logits without the cache, whose size the config still gives (and the gated ones too: FSMT's
    logits differ with and without it)."""
    for stack in STACKS:
        model = build_tiny(cls)
        inputs = {**tiny_inputs(model), "use_cache": False}
        reference = logits(model, inputs)
        try:
            gates = attach_gates(model, [layer_kind(stack)], init_log_alpha=5.0).set_mode("deterministic")
        except FFNError as error:  # a mixture of experts: the one-line refusal, less the kind and class
            raise NotSupported(str(error).partition(": ")[2].partition("; allowed")[0]) from error
        _check(torch.equal(logits(model, inputs), reference), f"open {stack} layer gates change the logits")
        with torch.no_grad():
            gates.gates[-1].log_alpha.fill_(-5.0)  # the last layer: nothing after it reads its index
        gated = logits(model, inputs)
        gates.remove()
        shorter = build_tiny(cls)
        layers = shorter.get_submodule(probe(shorter).layers[stack])
        del layers[len(layers) - 1]
        _closed_gate_is(reference, gated, logits(shorter, inputs), f"{stack} layer gate is not the layer deleted")


def _unit_plan(site) -> list[int]:
    """Units kept: two of every three in a stack's first layer, none in the others (a block with no width)."""
    return [u for u in range(site.num_units) if u % 3] if site.layer == 0 else []


def _layer_plan(kept: dict[str, list[int]]) -> Callable[[nn.Module], dict]:
    return lambda model: {path: kept[stack] for stack, path in probe(model).layers.items()}


def kind_steps(cls: type, group: str, directory: Path) -> dict[str, Callable[[], None]]:
    """The checks of one group of kinds (``GROUPS``), by the name a failure is reported under."""
    if group == "heads":
        return {
            "gates": lambda: check_gates(cls),
            "surgery": lambda: check_surgery(cls, lambda s: PLAN[s.kind][s.layer], directory / "some"),
            "surgery, every head removed": lambda: check_surgery(cls, lambda s: [], directory / "none"),
        }
    if group == "ffn":
        return {"unit gates": lambda: check_unit_gates(cls),
                "unit surgery": lambda: check_surgery(cls, _unit_plan, directory / "units", FFN_KINDS)}
    if group == "layers":
        return {"layer gates": lambda: check_layer_gates(cls)} | {
            f"layer surgery (kept {kept})": lambda kept=kept, i=i: check_plan_surgery(cls, _layer_plan(kept),
                                                                                      directory / f"layers{i}")
            for i, kept in enumerate(LAYER_PLANS)}
    raise ValueError(f"unknown group {group!r}; allowed: {', '.join(GROUPS)}")


def check_kind(cls: type, group: str, directory: Path) -> None:
    """Every check of one group of kinds; raises ``NotSupported`` with the reason of the first that fails."""
    for step, check in kind_steps(cls, group, directory).items():
        try:
            check()
        except NotSupported:
            raise
        except Exception as error:  # noqa: BLE001  (the class computes or loads wrong once gated or cut)
            raise NotSupported(f"{step} fails: {_error(error, 160)}") from error


def prepare(cls: type) -> str:
    """The layout of ``cls``, once it builds tiny, its layout is found and the untouched model runs on the generic
    inputs; raises ``NotSupported`` with the reason otherwise (then no kind is checked)."""
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
    return structure.describe()


def check_class(cls: type, directory: Path) -> str:
    """The layout of ``cls`` (as the support table writes it) when its attention heads pass every check; raises
    ``NotSupported`` with the reason."""
    layout = prepare(cls)
    check_kind(cls, "heads", directory)
    return layout


def check_kinds(cls: type, directory: Path) -> tuple[str | None, dict[str, str | None]]:
    """The layout of ``cls`` (None where it has none) and, per group of kinds, None where every check passes or the
    one-line reason; the groups are checked independently, so FFN units may pass where heads fail."""
    try:
        layout = prepare(cls)
    except NotSupported as error:
        return None, {group: str(error) for group in GROUPS}
    reasons = {}
    for group in GROUPS:
        try:
            check_kind(cls, group, directory / group)
            reasons[group] = None
        except NotSupported as error:
            reasons[group] = str(error)
    return layout, reasons
