"""Runtime of a seq2seq model whose attention heads, feed-forward units or layers were removed by gatedprune.

This file is both the cutting routine that ``gatedprune.surgery.cut`` calls and the self-contained modeling file the
exporter writes beside the weights (as ``modeling_gatedprune.py``) so that
``AutoModelForSeq2SeqLM.from_pretrained(d, trust_remote_code=True)`` works; it therefore imports only torch and
transformers and takes everything it needs to know about the family from the plan record in ``config.gatedprune``:

    {"format": 3,
     "kept_heads": {kind: {attention module path: kept query heads (in the original numbering)}},
     "num_heads": {path: query heads before pruning}, "num_kv_heads": {path: key/value heads before pruning},
     "slots": {path: query heads physically present, original numbering (kept heads, plus zero-output fillers
               where grouped-query attention needs every key/value head to serve the same number of query heads)},
     "kv_heads": {path: key/value heads physically present, original numbering},
     "layout": {"encoder" | "decoder" (the stack): {"q", "k", "v", "o": projection names (dotted where nested),
                "head_dim_attr", "count_attrs", "kv_count_attrs", "group_attr", "inner_dim_attr",
                "position_bias_attr": attribute names (the last three may be null),
                "position_bias": "shared" | "per-layer" | null}},
     "kept_units": {kind: {feed-forward output projection path: kept units (original numbering)}},
     "num_units": {path: units before pruning},
     "kept_layers": {stack: original indices of the layers present}, "num_layers": {stack: layers before pruning},
     "dropped": {stack: [{"layer": original index, "parameters": its parameters, "heads": {kind: n},
                          "units": {kind: n}}]},
     (the layout of each stack also holds "name", "layers": the path of its ModuleList, "self_attention" and
      "cross_attention": paths inside a layer, "ffn": {"container", "inputs", "output"} or null, "bias_flag_attr")
     "rule": how the plan was made (e.g. "binary") or null,
     "source_model", "versions": added by the exporter}
"""

from __future__ import annotations

import functools
import pickle

import torch
import transformers  # noqa: F401  (the line the exporter appends names a transformers class)
from torch import nn

CONFIG_KEY = "gatedprune"  # attribute of the model config (and key of config.json) holding the plan record


class PlanRecord(dict):
    """The plan record as a live config holds it. generate() deep-copies a flat encoder-decoder config several times
    a call (transformers' ``get_text_config(decoder=True)`` and ``to_dict``); copied item by item, a record's kept
    indices (every kept unit of every layer) slowed a batch-1 generate() of the teacher's shapes by 6-13%
    (docs/recovery.md). One pickle round trip of our own in-memory data copies it whole, in C."""

    def __deepcopy__(self, memo: dict) -> "PlanRecord":
        return PlanRecord(pickle.loads(pickle.dumps(dict(self), protocol=pickle.HIGHEST_PROTOCOL)))


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """Indices of the features of ``heads`` in a head-major (H * D) projection.  # (len(heads) * D,)"""
    heads = torch.as_tensor(heads, dtype=torch.long).reshape(-1, 1)  # (K, 1)
    return (heads * head_dim + torch.arange(head_dim)).flatten()


def _keep_features(linear: nn.Linear, index: torch.Tensor, dim: int) -> None:
    """Keep the output features (dim 0) or input features (dim 1) of ``linear`` at ``index``, in place."""
    weight = linear.weight.detach().index_select(dim, index.to(linear.weight.device)).clone()
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if dim == 0:
        linear.out_features = len(index)
        if linear.bias is not None:  # the output bias belongs to the output features
            bias = linear.bias.detach().index_select(0, index.to(linear.bias.device)).clone()
            linear.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
    else:
        linear.in_features = len(index)  # the output bias is kept whole: it is added whatever heads remain


def attr(module: nn.Module, name: str, default=None):
    """``module``'s attribute at a dotted ``name`` ("q_proj", or "self.query" where a family nests its parts)."""
    for part in name.split("."):
        module = getattr(module, part, default)
    return module


def _set(module: nn.Module, names, value: int) -> None:
    """Set whichever of the counters ``names`` (dotted) the module has (families keep different ones)."""
    for name in names or ():
        owner, _, leaf = (name or "").rpartition(".")
        owner = attr(module, owner) if owner else module
        if name and hasattr(owner, leaf):
            setattr(owner, leaf, value)


def prune_attention(module: nn.Module, slots: list[int], kv_heads: list[int], layout: dict, fillers=()) -> None:
    """Keep query heads ``slots`` and key/value heads ``kv_heads`` (indices among the module's current heads), in place.

    The q rows and output-projection columns of every other query head go, and the k/v rows of every other
    key/value head; slot i then reads key/value head i // (len(slots) / len(kv_heads)), as grouped-query attention
    does. ``fillers`` (among ``slots``) are pruned heads kept only so that every key/value head serves the same
    number of query heads: their output-projection columns are zeroed, so they contribute nothing. Zero slots is
    allowed: the module then returns its output bias (zeros for bias-free families), as a fully gated module does.
    """
    head_dim = int(attr(module, layout["head_dim_attr"]))
    index = head_rows(slots, head_dim)  # (S * D,)
    _keep_features(attr(module, layout["q"]), index, dim=0)
    _keep_features(attr(module, layout["o"]), index, dim=1)
    kv_index = head_rows(kv_heads, head_dim)  # (K' * D,)
    for name in ("k", "v"):
        _keep_features(attr(module, layout[name]), kv_index, dim=0)
    if fillers:
        o = attr(module, layout["o"])
        with torch.no_grad():
            o.weight[:, head_rows([slots.index(f) for f in fillers], head_dim).to(o.weight.device)] = 0
    bias = getattr(module, layout.get("position_bias_attr") or "", None)
    if layout.get("position_bias") == "per-layer" and isinstance(bias, nn.Embedding):  # (buckets, H): own columns
        bias.weight = nn.Parameter(bias.weight.detach()[:, slots].clone(), requires_grad=bias.weight.requires_grad)
        bias.embedding_dim = len(slots)
    heads, kv = (len(slots), len(kv_heads)) if slots else (1, 1)  # no heads: the counters of one phantom head
    _set(module, layout["count_attrs"], heads)
    _set(module, layout["kv_count_attrs"], kv)
    _set(module, [layout["group_attr"]], heads // kv)
    _set(module, [layout["inner_dim_attr"]], heads * head_dim)


def prune_ffn(container: nn.Module, kept: list[int], ffn: dict) -> None:
    """Keep the intermediate units ``kept`` (current indices) of a feed-forward block, in place: their rows of every
    input projection, their columns of the output projection. Zero units is allowed: the block returns its output
    bias (zeros for bias-free families), as a block with every unit gated off does."""
    index = torch.as_tensor(kept, dtype=torch.long)  # (F',)
    for name in ffn["inputs"]:
        _keep_features(attr(container, name), index, dim=0)
    _keep_features(attr(container, ffn["output"]), index, dim=1)


def _layer_count_names(stack: str, own: bool) -> tuple[str, ...]:
    """Config fields that count a stack's layers: on the model's config, the stack's own names; on a stack's own
    config (T5's stacks, T5Gemma's sub-configs), also the generic ones."""
    names = {"encoder": ("encoder_layers", "num_layers", "encoder_num_hidden_layers"),
             "decoder": ("decoder_layers", "num_decoder_layers", "decoder_num_hidden_layers")}[stack]
    return names + (("num_layers", "num_hidden_layers") if own else ())


def _stack_configs(model: nn.Module, stack_module: nn.Module, stack: str) -> list[tuple[object, bool]]:
    """(config, is the stack's own) of every config object that describes the stack's depth."""
    found = [(model.config, False)]
    for config in (getattr(stack_module, "config", None), getattr(model.config, stack, None)):
        if config is not None and hasattr(config, "to_dict") and all(config is not c for c, _ in found):
            found.append((config, True))
    return found


def drop_layers(model: nn.Module, layers_path: str, kept: list[int], stack: str, layout: dict) -> int:
    """Keep the layers ``kept`` (current indices) of a stack, in place; returns the parameters of a moved position
    bias (which stay). What indexes layers follows: the ``layer_idx`` of every module (transformers v5 caches key
    their layers by it), the config's layer counts and per-layer lists (``layer_types``), and a relative position
    bias owned by the first layer (T5), which moves to the new first layer."""
    layers = model.get_submodule(layers_path)
    moved = 0
    owner = attr(layers[0], layout["self_attention"]) if len(layers) else None
    table = getattr(owner, layout.get("position_bias_attr") or "", None)
    if layout.get("position_bias") == "shared" and isinstance(table, nn.Embedding) and kept and kept[0] != 0:
        heir = attr(layers[kept[0]], layout["self_attention"])
        copy = nn.Embedding(table.num_embeddings, table.embedding_dim).to(table.weight.device)
        copy.weight = nn.Parameter(table.weight.detach().clone(), requires_grad=table.weight.requires_grad)
        setattr(heir, layout["position_bias_attr"], copy)  # a new module: the hooks of the old owner stay behind
        if layout.get("bias_flag_attr"):
            setattr(heir, layout["bias_flag_attr"], True)
        moved = table.weight.numel()
    survivors = [layers[i] for i in kept]
    for new, layer in enumerate(survivors):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new
    parent, _, name = layers_path.rpartition(".")
    stack_module = model.get_submodule(parent) if parent else model
    setattr(stack_module, name, nn.ModuleList(survivors))
    for config, own in _stack_configs(model, stack_module, stack):
        for field in _layer_count_names(stack, own):
            if isinstance(getattr(config, field, None), int) and field in config.to_dict():
                setattr(config, field, len(kept))
        types = getattr(config, "layer_types", None)
        if own and isinstance(types, list) and len(types) == len(layers):
            config.layer_types = [types[i] for i in kept]
    return moved


def size_generation_cache(model: nn.Module, decoder_layers: int) -> None:
    """Make the generation cache as deep as the decoder. transformers sizes it from the decoder view of the config
    (``config.get_text_config(decoder=True)``), which for a flat encoder-decoder config is a copy that reads
    ``decoder_layers`` as its ``num_hidden_layers``. T5 names its decoder depth ``num_decoder_layers``, so its view
    counts the encoder's layers, and a decoder left deeper than its encoder would index past the cache; such a
    config is given ``decoder_layers`` too (which the drop of a layer then keeps in step)."""
    view = model.config.get_text_config(decoder=True)
    if getattr(view, "layer_types", None) is not None or getattr(view, "num_hidden_layers", None) in (None,
                                                                                                     decoder_layers):
        return
    model.config.decoder_layers = decoder_layers


def layout_of(record: dict, path: str) -> dict:
    """The layout of the stack that holds attention module ``path`` (encoder self-attention: the encoder's)."""
    return record["layout"]["encoder" if path in record["kept_heads"].get("encoder", {}) else "decoder"]


def upgrade_record(record: dict) -> dict:
    """An older record as format 3: format 1 (multi-head attention only, written before grouped heads were
    supported) and format 2 (heads only) name no units or layers, so none were removed."""
    if record.get("format", 1) == 2:
        return {**record, "format": 3, "kept_units": {}, "num_units": {}, "kept_layers": {}, "num_layers": {},
                "dropped": {}}
    if record.get("format", 1) >= 3:
        return record
    old = record["layout"]
    kept = {path: heads for per_kind in record["kept_heads"].values() for path, heads in per_kind.items()}
    layout = {name: old[name] for name in ("q", "k", "v", "o", "head_dim_attr", "inner_dim_attr", "position_bias_attr")}
    layout.update(
        count_attrs=[old["num_heads_attr"]], kv_count_attrs=[], group_attr=None,
        position_bias="shared" if old.get("position_bias_attr") else None,
    )
    return upgrade_record({
        **record, "format": 2, "layout": {"encoder": layout, "decoder": layout}, "num_kv_heads": dict(record["num_heads"]),
        "slots": {p: list(k) for p, k in kept.items()}, "kv_heads": {p: list(k) for p, k in kept.items()},
    })


class SharedBiasHeads:
    """Lets one pruned attention module of a stack that shares its position bias (T5) use its own heads of it.

    T5 computes the relative position bias once, in block 0, for all H heads, and hands the tensor (1, H, Q, K)
    from layer to layer; cross-attention likewise hands on the zero bias its first layer builds with its own head
    count. After pruning, the tensor handed on stays in the original head space: each pruned module picks its
    kept heads on the way in and hands the full tensor on the way out, so layers with different heads agree.
    """

    def __init__(self, kept: list[int], num_heads: int):
        self.kept = list(kept)
        self.num_heads = num_heads  # H before pruning
        self._full: torch.Tensor | None = None  # (1, H, Q, K) of the call in progress

    def _own(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if not self.kept:  # the phantom head of a module without heads (see PhantomHead): a zero bias
            shape = list(full.shape)
            shape[dim] = 1
            return full.new_zeros(shape)
        return full.index_select(dim, torch.as_tensor(self.kept, dtype=torch.long, device=full.device))

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of the attention module: the incoming full bias -> its kept heads."""
        self._full = None
        bias = kwargs.get("position_bias")
        if bias is None:
            return None
        if bias.shape[1] != self.num_heads:
            raise RuntimeError(
                f"position bias with {bias.shape[1]} heads reached a pruned attention module that expects the "
                f"original {self.num_heads}; was a layer of this stack pruned outside gatedprune?"
            )
        self._full = bias
        return args, {**kwargs, "position_bias": self._own(bias, 1)}

    def on_bias_table(self, table: nn.Module, args: tuple, values: torch.Tensor) -> torch.Tensor:
        """Forward hook of the relative-position embedding (block 0): keep all heads for later layers."""
        # values: (Q, K, H); compute_bias arranges it as (1, H, Q, K)
        self._full = values.permute(2, 0, 1).unsqueeze(0)
        return self._own(values, -1)  # (Q, K, len(kept))

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        """Forward hook of the attention module: hand on the full bias instead of this module's heads of it."""
        attn_output, bias, *rest = output
        full, self._full = self._full, None
        if full is None:  # no bias came in and none was computed: the module built zeros for its own heads
            full = bias.new_zeros(bias.shape[0], self.num_heads, *bias.shape[2:])
        return (attn_output, full, *rest)


def _share_bias(model: nn.Module, path: str, kept: list[int], num_heads: int, bias_attr: str) -> None:
    """Install (or update) the ``SharedBiasHeads`` hooks of one pruned attention module."""
    module = model.get_submodule(path)
    heads = getattr(module, "gatedprune_shared_bias", None)
    if heads is None:
        heads = SharedBiasHeads(kept, num_heads)
        module.register_forward_pre_hook(heads.before, with_kwargs=True)
        module.register_forward_hook(heads.after, with_kwargs=True)
        module.gatedprune_shared_bias = heads  # a plain attribute; found again when the plan changes
    table = getattr(module, bias_attr, None)  # only the first layer of a stack owns the embedding
    if isinstance(table, nn.Module) and not getattr(table, "gatedprune_hooked", False):  # new, or moved in
        table.register_forward_hook(heads.on_bias_table)
        table.gatedprune_hooked = True
    heads.kept = list(kept)


class PhantomHead:
    """Hooks of an attention module left without heads: it computes with one head of zeros instead of none.

    Families reshape with their head counter (``view(B, -1, H, D)`` cannot infer -1 when H = 0), and transformers'
    DynamicLayer reports length 0 for a cache slot that holds no elements, while the decoder takes its position
    from the length of slot 0. So the module keeps a counter of one head, its q/k/v projections (no rows left)
    hand out one head of zeros, and its output projection drops that head again: the module returns its output
    bias (zeros for bias-free families), as a gated module with every gate closed does. Costs no parameters.
    """

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def project(self, projection: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(*output.shape[:-1], self.head_dim)  # (B, T, 0) -> (B, T, D)

    def drop(self, o_proj: nn.Module, args: tuple) -> tuple:
        (x, *rest) = args  # (B, T, D): the phantom head's output
        return (x[..., :0], *rest)  # (B, T, 0)

    def bias_column(self, table: nn.Module, args: tuple, values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(*values.shape[:-1], 1)  # per-layer position bias (Q, K, 0) -> (Q, K, 1)


def _add_phantom_head(module: nn.Module, layout: dict) -> None:
    if getattr(module, "gatedprune_phantom_head", None) is None:
        phantom = PhantomHead(int(attr(module, layout["head_dim_attr"])))
        for name in ("q", "k", "v"):
            attr(module, layout[name]).register_forward_hook(phantom.project)
        attr(module, layout["o"]).register_forward_pre_hook(phantom.drop)
        table = getattr(module, layout.get("position_bias_attr") or "", None)
        if layout.get("position_bias") == "per-layer" and isinstance(table, nn.Module):
            table.register_forward_hook(phantom.bias_column)
        module.gatedprune_phantom_head = phantom


def pruned_paths(record: dict) -> dict[str, list[int]]:
    """``{path: query slots}`` of the modules of the record that were cut (lost a query or a key/value head)."""
    return {
        path: slots
        for path, slots in record["slots"].items()
        if slots != list(range(record["num_heads"][path]))
        or record["kv_heads"][path] != list(range(record["num_kv_heads"][path]))
    }


def install_runtime(model: nn.Module, record: dict) -> None:
    """The hooks a pruned model needs beyond its smaller weights; idempotent, so pruning again updates them.

    Families sharing a position bias across layers (T5): every pruned module picks its own heads of it. A module
    left without heads computes with a phantom head of zeros (see ``PhantomHead``).
    """
    for path, slots in pruned_paths(record).items():
        layout = layout_of(record, path)
        if layout.get("position_bias") == "shared":
            _share_bias(model, path, slots, record["num_heads"][path], layout["position_bias_attr"])
        if not slots:
            _add_phantom_head(model.get_submodule(path), layout)


def restore_pruned(model: nn.Module, record: dict) -> None:
    """Cut a freshly built (unpruned) model to the shapes of ``record``; loading the weights comes after. Its
    config already counts the layers that stay, so the model is built without the dropped ones."""
    record = upgrade_record(record)
    for kind, per_path in record["kept_units"].items():
        ffn = record["layout"][kind.partition("_")[0]]["ffn"]
        for path, units in per_path.items():
            if units != list(range(record["num_units"][path])):
                container = path[: -len(ffn["output"]) - 1]
                prune_ffn(model.get_submodule(container) if container else model, units, ffn)
    kept = {path: heads for per_kind in record["kept_heads"].values() for path, heads in per_kind.items()}
    for path, slots in pruned_paths(record).items():
        fillers = [head for head in slots if head not in kept[path]]
        prune_attention(model.get_submodule(path), slots, record["kv_heads"][path], layout_of(record, path), fillers)
    install_runtime(model, record)


@functools.cache
def pruned_model_class(base: type) -> type:
    """``base`` (a transformers seq2seq class) whose constructor gives the pruned shapes of ``config.gatedprune``."""

    class GatedPruned(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if getattr(config, CONFIG_KEY, None) is not None:  # without a plan, it is just `base`
                setattr(config, CONFIG_KEY, PlanRecord(getattr(config, CONFIG_KEY)))
                restore_pruned(self, getattr(config, CONFIG_KEY))

    GatedPruned.__name__ = GatedPruned.__qualname__ = f"GatedPruned{base.__name__}"
    GatedPruned.__doc__ = f"{base.__name__} with the heads, units and layers that ``config.{CONFIG_KEY}`` keeps."
    return GatedPruned


# The exporter appends the line that names the class of the exported family, e.g.
# GatedPrunedMarianMTModel = pruned_model_class(transformers.MarianMTModel)
