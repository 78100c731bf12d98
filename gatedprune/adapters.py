"""Where the attention heads of each supported seq2seq family live.

One data-only table maps a ``config.model_type`` to the location of its three attention kinds and the
names of their projections; everything else in gatedprune is generic code driven by it. Adding a family
is one table entry plus one entry in the tests' family list.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ATTENTION_KINDS = ("encoder", "decoder", "cross")


@dataclass(frozen=True)
class FamilyAdapter:
    layers: dict[str, str]  # stack ("encoder" | "decoder") -> path of its ModuleList of layers
    attention: dict[str, tuple[str, str]]  # kind -> (stack, attention path inside one layer)
    q: str
    k: str
    v: str
    o: str
    num_heads_attr: str
    head_dim_attr: str
    inner_dim_attr: str | None = None  # attribute holding heads * head_dim, if the family keeps one
    # T5: the relative position bias embedding (buckets, heads) lives in the first layer of each stack
    position_bias_attr: str | None = None


_BART_LIKE = FamilyAdapter(
    layers={"encoder": "model.encoder.layers", "decoder": "model.decoder.layers"},
    attention={
        "encoder": ("encoder", "self_attn"),
        "decoder": ("decoder", "self_attn"),
        "cross": ("decoder", "encoder_attn"),
    },
    q="q_proj",
    k="k_proj",
    v="v_proj",
    o="out_proj",
    num_heads_attr="num_heads",
    head_dim_attr="head_dim",
)

_T5_LIKE = FamilyAdapter(
    layers={"encoder": "encoder.block", "decoder": "decoder.block"},
    attention={
        "encoder": ("encoder", "layer.0.SelfAttention"),
        "decoder": ("decoder", "layer.0.SelfAttention"),
        "cross": ("decoder", "layer.1.EncDecAttention"),
    },
    q="q",
    k="k",
    v="v",
    o="o",
    num_heads_attr="n_heads",
    head_dim_attr="key_value_proj_dim",
    inner_dim_attr="inner_dim",
    position_bias_attr="relative_attention_bias",
)

ADAPTERS: dict[str, FamilyAdapter] = {
    "bart": _BART_LIKE,
    "mbart": _BART_LIKE,
    "marian": _BART_LIKE,
    "pegasus": _BART_LIKE,
    "m2m_100": _BART_LIKE,
    "t5": _T5_LIKE,
    "mt5": _T5_LIKE,
}


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model: its path (as in ``named_modules``), kind and layer."""

    path: str
    kind: str
    layer: int
    module: nn.Module
    adapter: FamilyAdapter

    @property
    def num_heads(self) -> int:
        return int(getattr(self.module, self.adapter.num_heads_attr))

    @property
    def head_dim(self) -> int:
        return int(getattr(self.module, self.adapter.head_dim_attr))

    def projection(self, name: str) -> nn.Linear:
        """``name`` is one of "q", "k", "v", "o"."""
        return getattr(self.module, getattr(self.adapter, name))


def adapter_for(model: nn.Module) -> FamilyAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"unsupported model class {type(model).__name__} (model_type={model_type!r}); "
            f"supported model types: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]


def check_kinds(kinds) -> tuple[str, ...]:
    """Validate a list of attention kinds; returns them as a tuple in canonical order."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in ATTENTION_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown attention kind(s) {unknown or list(kinds)}; allowed: {', '.join(ATTENTION_KINDS)}")
    return tuple(k for k in ATTENTION_KINDS if k in kinds)


def attention_sites(model: nn.Module, kinds=ATTENTION_KINDS) -> list[AttentionSite]:
    """Every attention module of the requested kinds, in (kind, layer) order."""
    adapter = adapter_for(model)
    sites = []
    for kind in check_kinds(kinds):
        stack, inner = adapter.attention[kind]
        layers_path = adapter.layers[stack]
        layers = model.get_submodule(layers_path)
        for i in range(len(layers)):
            path = f"{layers_path}.{i}.{inner}"
            sites.append(AttentionSite(path, kind, i, model.get_submodule(path), adapter))
    if not sites:
        raise ValueError(f"no attention modules of kinds {list(kinds)} found in {type(model).__name__}")
    return sites
