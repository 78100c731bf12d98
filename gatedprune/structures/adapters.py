"""Where the attention heads of an encoder-decoder model live, found by probing its modules.

A ``Layout`` is a data-only description of one way transformers writes attention: the names of the q/k/v/output
projections, of the head-size attribute, of the attention modules inside a layer, and of the counters a surgery must
keep in step. ``probe`` walks the model's ``nn.ModuleList``s, finds the encoder stack (layers with self-attention
only) and the decoder stack (self- and cross-attention) that one layout describes, and reads the variants off the
structure: grouped key/value heads (fewer k rows than q rows), a relative position bias owned by the first layer
and shared, or owned by every layer. Everything else in gatedprune is generic code driven by the result.
A model no layout describes, or that two describe, is refused with what was found; ``pin_layout`` decides for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from gatedprune.structures.kinds import ATTENTION_KINDS, check_kinds  # noqa: F401  (check_kinds: API)
from gatedprune.surgery.pruned_modeling import CONFIG_KEY, attr

PIN_KEY = "gatedprune_layout"  # config attribute holding a user-pinned layout (travels in config.json)


class LayoutError(ValueError):
    """No layout, or more than one, describes a model; ``short`` is the one-line reason without the advice."""

    def __init__(self, message: str, short: str):
        super().__init__(message)
        self.short = short


@dataclass(frozen=True)
class Layout:
    name: str
    q: str
    k: str
    v: str
    o: str
    head_dim_attr: str
    self_names: tuple[str, ...]  # path of the self-attention inside one layer, first that exists
    cross_names: tuple[str, ...]  # path of the cross-attention inside one decoder layer
    count_attrs: tuple[str, ...] = ("num_heads",)  # query-head counters, set by surgery where the module has them
    kv_count_attrs: tuple[str, ...] = ("num_key_value_heads",)  # key/value-head counters, likewise
    group_attr: str | None = "num_key_value_groups"  # query heads per key/value head (grouped-query attention)
    inner_dim_attr: str | None = None  # attribute holding heads * head_dim, if the family keeps one
    position_bias_attr: str | None = None  # relative position bias embedding (buckets, heads), if any
    bias_flag_attr: str | None = None  # attribute saying which attention module owns a shared position bias


_SELF = ("self_attn", "self_attention", "attention")
_CROSS = ("encoder_attn", "cross_attention", "cross_attn")

LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("bart-like", "q_proj", "k_proj", "v_proj", "out_proj", "head_dim", _SELF, _CROSS, inner_dim_attr="embed_dim"),
        Layout("llama-like", "q_proj", "k_proj", "v_proj", "o_proj", "head_dim", _SELF, _CROSS),
        Layout(  # BERT as encoder and decoder of an EncoderDecoderModel: the output projection sits beside the rest
            "bert-like", "self.query", "self.key", "self.value", "output.dense", "self.attention_head_size",
            ("attention",), ("crossattention",), count_attrs=("self.num_attention_heads",),
            inner_dim_attr="self.all_head_size",
        ),
        Layout(
            "t5-like", "q", "k", "v", "o", "key_value_proj_dim", ("layer.0.SelfAttention",), ("layer.1.EncDecAttention",),
            count_attrs=("n_heads",), inner_dim_attr="inner_dim", position_bias_attr="relative_attention_bias",
            bias_flag_attr="has_relative_attention_bias",
        ),
    )
}

@dataclass(frozen=True)
class Structure:
    """What ``probe`` found: the two stacks, the layout of each (a SpeechEncoderDecoderModel may pair two), the
    variants."""

    layouts: dict[str, Layout]  # "encoder" | "decoder" -> the layout of that stack's attention
    layers: dict[str, str]  # "encoder" | "decoder" -> path of the ModuleList of layers
    attention: dict[str, tuple[str, str]]  # kind -> (stack, attention path inside one layer)
    position_bias: dict[str, str | None]  # stack -> "shared" (first layer owns it), "per-layer", or None
    grouped: bool  # some attention module has fewer key/value heads than query heads

    def describe(self) -> str:
        variants = sorted({f"{v} position bias" for v in self.position_bias.values() if v})
        variants += ["grouped key/value heads"] if self.grouped else []
        encoder, decoder = self.layouts["encoder"].name, self.layouts["decoder"].name
        names = encoder if encoder == decoder else f"{encoder} encoder, {decoder} decoder"
        return names + (f" ({', '.join(variants)})" if variants else "")


def _linear(module: nn.Module, name: str) -> bool:
    return isinstance(attr(module, name), nn.Linear)


def _matches(module: nn.Module | None, layout: Layout) -> bool:
    """``module`` is an attention module of ``layout``: its four projections and its head size."""
    return (
        module is not None
        and all(_linear(module, getattr(layout, p)) for p in ("q", "k", "v", "o"))
        and isinstance(attr(module, layout.head_dim_attr), int)
    )


def _first(layer: nn.Module, names: tuple[str, ...], layout: Layout) -> str | None:
    """The first of ``names`` that is an attention module of ``layout`` inside ``layer``."""
    for name in names:
        try:
            module = layer.get_submodule(name)
        except AttributeError:
            continue
        if _matches(module, layout):
            return name
    return None


def _attention_like(module: nn.Module) -> bool:
    """Three or more linear children, one of them a query: what an attention module of any layout looks like."""
    names = [n for n, child in module.named_children() if isinstance(child, nn.Linear)]
    return len(names) >= 3 and any(n.lower().startswith(("q", "to_q", "linear_q")) for n in names)


def _unplaced(model: nn.Module, placed: set[int]) -> str:
    """Each class of attention-like module outside the stacks found (by id in ``placed``): where the first is,
    and its linear children."""
    seen, found = set(), []
    for path, module in model.named_modules():
        kind = type(module).__name__
        if _attention_like(module) and kind not in seen and id(module) not in placed:
            seen.add(kind)
            linears = [n for n, c in module.named_children() if isinstance(c, nn.Linear)]
            found.append(f"{kind}({', '.join(linears)}) at {path}")
    return "; ".join(found)


def _other_head_parts(module: nn.Module, layout: Layout) -> list[str]:
    """Linear children and parameters of ``module`` other than the layout's, shaped per query head (H * D rows, or
    (H, D)): a relative-key projection or per-head biases, which surgery would have to cut as well."""
    q, head_dim = attr(module, layout.q), int(attr(module, layout.head_dim_attr))
    own = {getattr(layout, p) for p in ("q", "k", "v", "o")}
    parts = [
        name for name, child in module.named_children()
        if isinstance(child, nn.Linear) and name not in own and child.out_features == q.out_features
    ]
    parts += [
        name for name, p in module.named_parameters(recurse=False)
        if tuple(p.shape) == (q.out_features // head_dim, head_dim)
    ]
    return parts


def _stacks(model: nn.Module, layout: Layout) -> tuple[dict[str, list[str]], dict[str, tuple[str, str]]]:
    """Every ModuleList whose layers all hold attention of ``layout``, as encoder-like or decoder-like stacks."""
    stacks: dict[str, list[str]] = {"encoder": [], "decoder": []}
    inner: dict[str, tuple[str, str]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        self_names = {_first(layer, layout.self_names, layout) for layer in module}
        cross_names = {_first(layer, layout.cross_names, layout) for layer in module}
        if len(self_names) != 1 or None in self_names or len(cross_names) != 1:
            continue  # not every layer has the same self-attention
        (self_name,), (cross_name,) = self_names, cross_names
        stack = "encoder" if cross_name is None else "decoder"
        stacks[stack].append(path)
        inner[path] = (self_name, cross_name)
    return stacks, inner


def _pinned(model: nn.Module) -> dict | None:
    return getattr(getattr(model, "config", None), PIN_KEY, None)


def pin_layout(model: nn.Module, layout: str | dict) -> None:
    """Decide the layout of a model the probe cannot: a layout name, or a dict with ``base`` (a layout name), any
    ``Layout`` fields to change, and ``encoder_layers`` / ``decoder_layers`` (paths of the two stacks) to choose among
    the stacks found. Kept on the config, so a saved model carries it."""
    pin = {"base": layout} if isinstance(layout, str) else dict(layout)
    base = pin.get("base")
    fields = {f.name for f in dataclasses.fields(Layout)} - {"name"}
    unknown = set(pin) - fields - {"base", "encoder_layers", "decoder_layers"}
    if base not in LAYOUTS or unknown:
        raise ValueError(
            f"a pinned layout needs base (one of {', '.join(LAYOUTS)}), got {base!r}"
            + (f"; unknown keys {sorted(unknown)}, allowed: {', '.join(sorted(fields))}, encoder_layers, decoder_layers"
               if unknown else "")
        )
    setattr(model.config, PIN_KEY, pin)
    probe(model)  # refuse a pin that does not describe the model, now rather than at the first forward


def _pinned_layout(pin: dict) -> Layout:
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in pin.items() if k not in ("base", "encoder_layers", "decoder_layers")}
    return dataclasses.replace(LAYOUTS[pin["base"]], name=f"{pin['base']} (pinned)", **changes)


def _emptied_stacks(model: nn.Module, layouts: list[Layout]) -> dict:
    """The stacks a plan removed every layer of (an encoder), as the plan record on the config describes them: an
    empty ModuleList matches no layout, so the record says what it held."""
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None) or {}
    found = {}
    for stack, described in (record.get("layout") or {}).items():
        path = described.get("layers")
        try:
            module = model.get_submodule(path) if path else None
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList) and len(module) == 0:
            layout = next((l for l in layouts if l.name == described.get("name")), layouts[0])
            found[stack] = (layout, path, (described["self_attention"], described.get("cross_attention")))
    return found


def probe(model: nn.Module) -> Structure:
    """The attention structure of ``model``, by matching its modules against ``LAYOUTS`` (or the pinned layout)."""
    pin = _pinned(model)
    layouts = [_pinned_layout(pin)] if pin else list(LAYOUTS.values())
    found: dict[str, list[tuple[Layout, str, tuple[str, str | None]]]] = {"encoder": [], "decoder": []}
    placed = set()  # ids of the attention modules inside the stacks found
    for layout in layouts:
        stacks, inner = _stacks(model, layout)
        for stack, paths in stacks.items():
            wanted = pin.get(f"{stack}_layers") if pin else None
            found[stack] += [(layout, path, inner[path]) for path in paths if wanted in (None, path)]
            for path in paths:
                for layer in model.get_submodule(path):
                    placed.update(id(layer.get_submodule(n)) for n in inner[path] if n is not None)
    for stack, (layout, path, inner) in _emptied_stacks(model, layouts).items():
        if not found[stack]:
            found[stack].append((layout, path, inner))
    name = type(model).__name__
    advice = "pin a layout (gatedprune.structures.adapters.pin_layout, or model.layout in the config) if one fits"
    encoders, decoders = ([path for _, path, _ in found[stack]] for stack in ("encoder", "decoder"))
    for paths in (encoders, decoders):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            both = ", ".join(layout.name for stack in found.values() for layout, path, _ in stack if path == twice[0])
            raise LayoutError(f"ambiguous model class {name}: layouts {both} all describe {twice[0]}; {advice}",
                              short=f"ambiguous: layouts {both} all describe {twice[0]}")
    if len(encoders) != 1 or len(decoders) != 1:
        unmatched = _unplaced(model, placed)
        first_unmatched = unmatched.split(" at ")[0] + (", ..." if ";" in unmatched else "")
        if not decoders:
            short = "no decoder layers with cross-attention"
        elif not encoders:
            short = f"decoder {', '.join(decoders)} matches, but no encoder layers do"
        else:
            short = f"encoder-like stacks {sorted(encoders)} and decoder stacks {sorted(decoders)}: not one of each"
        extra = (f"; self-attention stacks found: {sorted(encoders)}" if encoders and not decoders else "") + (
            f"; attention outside them: {unmatched}" if unmatched else "")
        raise LayoutError(
            f"unsupported model class {name}: {short} (layouts: {', '.join(l.name for l in layouts)}){extra}; {advice}",
            short=short + (f"; found {first_unmatched}" if unmatched else ""),
        )
    (encoder_layout, encoder_path, encoder_inner), = found["encoder"]
    (decoder_layout, decoder_path, decoder_inner), = found["decoder"]
    layouts = {"encoder": encoder_layout, "decoder": decoder_layout}
    layers = {"encoder": encoder_path, "decoder": decoder_path}
    attention = {
        "encoder": ("encoder", encoder_inner[0]),
        "decoder": ("decoder", decoder_inner[0]),
        "cross": ("decoder", decoder_inner[1]),
    }
    position_bias, grouped = {"encoder": None, "decoder": None}, False
    for kind, (stack, path) in attention.items():
        layout = layouts[stack]
        modules = [layer.get_submodule(path) for layer in model.get_submodule(layers[stack])]
        if not modules:  # a stack every layer of which a plan removed
            continue
        owners = [isinstance(getattr(m, layout.position_bias_attr or "", None), nn.Module) for m in modules]
        if owners[0] and kind != "cross":
            variant = "per-layer" if all(owners) else "shared" if not any(owners[1:]) else None
            if variant is None:
                raise LayoutError(
                    f"unsupported model class {name}: the {kind} layers own a position bias in layers "
                    f"{[i for i, o in enumerate(owners) if o]}; allowed: the first layer only (shared) or every layer",
                    short=f"{kind} position bias owned by some layers only",
                )
            position_bias[stack] = variant
        grouped |= any(attr(m, layout.k).out_features < attr(m, layout.q).out_features for m in modules)
        extra = sorted({part for m in modules for part in _other_head_parts(m, layout)})
        if extra:
            raise LayoutError(
                f"unsupported model class {name}: its {kind} attention {type(modules[0]).__name__} has per-head parts "
                f"besides {layout.name}'s q/k/v/o projections: {', '.join(extra)}; pruning would leave them whole",
                short=f"{kind} attention has per-head parts no layout cuts: {', '.join(extra)}",
            )
    return Structure(layouts, layers, attention, position_bias, grouped)


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model: its path (as in ``named_modules``), kind and layer."""

    path: str
    kind: str
    layer: int
    module: nn.Module
    layout: Layout
    own_position_bias: bool = False  # this module owns a per-layer relative position bias (buckets, heads)

    @property
    def head_dim(self) -> int:
        return int(attr(self.module, self.layout.head_dim_attr))

    @property
    def num_heads(self) -> int:
        """Query heads, read off the query projection (families differ in which counters they keep)."""
        return self.projection("q").out_features // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.projection("k").out_features // self.head_dim

    def projection(self, name: str) -> nn.Linear:
        """``name`` is one of "q", "k", "v", "o"."""
        return attr(self.module, getattr(self.layout, name))

    @property
    def num_units(self) -> int:
        return self.num_heads

    def head_parameters(self) -> tuple[int, int]:
        """(parameters of one query head, of one key/value head). A query head owns its q rows (and biases), its
        output-projection columns and, where every layer owns a relative position bias, its column of it; a
        key/value head owns its k and v rows (and biases)."""
        q, o = self.projection("q"), self.projection("o")
        per_query = self.head_dim * (q.in_features + (q.bias is not None) + o.out_features)
        if self.own_position_bias:
            per_query += getattr(self.module, self.layout.position_bias_attr).num_embeddings
        per_kv = sum(self.head_dim * (p.in_features + (p.bias is not None)) for p in map(self.projection, "kv"))
        return per_query, per_kv

    def unit_parameters(self) -> float:
        """Parameters one query head owns, with its share of a key/value head: what the expected kept size counts
        per head."""
        per_query, per_kv = self.head_parameters()
        return per_query + per_kv * self.num_kv_heads / max(1, self.num_heads)  # 0: a module left without heads

    def attach(self, value):
        """Gate the heads: the output projection's input (B, T, H*D), head-major (head h is [h*D, (h+1)*D)), times
        ``value(training)`` (H,), before W_O (Voita et al. 2019)."""
        head_dim = self.head_dim

        def hook(o_proj: nn.Module, args: tuple) -> tuple:
            (x, *rest) = args  # (B, T, H*D)
            g = value(o_proj.training).to(x.dtype)  # (H,)
            return ((x.unflatten(-1, (-1, head_dim)) * g[:, None]).flatten(-2), *rest)

        return [self.projection("o").register_forward_pre_hook(hook)]


def attention_sites(model: nn.Module, kinds=ATTENTION_KINDS) -> list[AttentionSite]:
    """Every attention module of the requested kinds, in (kind, layer) order."""
    structure = probe(model)
    sites = []
    for kind in (k for k in check_kinds(kinds) if k in ATTENTION_KINDS):
        stack, inner = structure.attention[kind]
        layers_path = structure.layers[stack]
        for i in range(len(model.get_submodule(layers_path))):
            path = f"{layers_path}.{i}.{inner}"
            own = structure.position_bias[stack] == "per-layer" and kind != "cross"
            sites.append(AttentionSite(path, kind, i, model.get_submodule(path), structure.layouts[stack], own))
    return sites
