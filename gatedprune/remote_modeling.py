"""Runtime of a seq2seq model whose attention heads were removed by gatedprune.

This file is both the cutting routine that ``gatedprune.surgery`` calls and the self-contained modeling file the
exporter writes beside the weights (as ``modeling_gatedprune.py``) so that
``AutoModelForSeq2SeqLM.from_pretrained(d, trust_remote_code=True)`` works; it therefore imports only torch and
transformers and takes everything it needs to know about the family from the plan record in ``config.gatedprune``:

    {"format": 1,
     "kept_heads": {kind: {attention module path: kept head indices (in the original numbering)}},
     "num_heads": {attention module path: head count before pruning},
     "layout": {"q", "k", "v", "o": projection names, "num_heads_attr", "head_dim_attr", "inner_dim_attr",
                "position_bias_attr": attribute names (the last two may be null)},
     "rule": how the plan was made (e.g. "binary") or null,
     "source_model", "versions": added by the exporter}
"""

from __future__ import annotations

import functools

import torch
import transformers  # noqa: F401  (the line the exporter appends names a transformers class)
from torch import nn

CONFIG_KEY = "gatedprune"  # attribute of the model config (and key of config.json) holding the plan record


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


def prune_attention(module: nn.Module, kept: list[int], layout: dict) -> None:
    """Keep only heads ``kept`` (indices among the module's current heads) of one attention module, in place.

    The q/k/v rows and the output-projection columns of every other head go; the head count (and the inner
    dimension, where the family keeps one) follow. Zero kept heads is allowed: the module then returns its output
    bias (zeros for bias-free families), as a gated module with every gate closed does.
    """
    index = head_rows(kept, int(getattr(module, layout["head_dim_attr"])))  # (K * D,)
    for name in ("q", "k", "v"):
        _keep_features(getattr(module, layout[name]), index, dim=0)
    _keep_features(getattr(module, layout["o"]), index, dim=1)
    setattr(module, layout["num_heads_attr"], len(kept))
    if layout.get("inner_dim_attr"):
        setattr(module, layout["inner_dim_attr"], len(index))


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
        table = getattr(module, bias_attr, None)  # only the first layer of a stack owns the embedding
        if isinstance(table, nn.Module):
            table.register_forward_hook(heads.on_bias_table)
        module.gatedprune_shared_bias = heads  # a plain attribute; found again when the plan changes
    heads.kept = list(kept)


class PhantomHead:
    """Forward hook of the k/v projections of a decoder self-attention left without heads: one head of zeros.

    transformers' DynamicLayer reports length 0 for a cache slot that holds no elements, and the decoder takes its
    position (position embeddings, causal mask, T5's bias offset) from the length of slot 0. Handing the cache one
    head of zeros keeps that length right; the query has no heads, so nothing attends to it and the output is
    still the output-projection bias. Costs one head of cache, no parameters.
    """

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def __call__(self, projection: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(*output.shape[:-1], self.head_dim)  # (B, T, 0) -> (B, T, D)


def _add_phantom_head(module: nn.Module, layout: dict) -> None:
    if getattr(module, "gatedprune_phantom_head", None) is None:
        phantom = PhantomHead(int(getattr(module, layout["head_dim_attr"])))
        for name in ("k", "v"):
            getattr(module, layout[name]).register_forward_hook(phantom)
        module.gatedprune_phantom_head = phantom


def pruned_paths(record: dict) -> dict[str, list[int]]:
    """``{path: kept heads}`` of the modules of the record that lost at least one head."""
    return {
        path: kept
        for per_kind in record["kept_heads"].values()
        for path, kept in per_kind.items()
        if len(kept) < record["num_heads"][path]
    }


def install_runtime(model: nn.Module, record: dict) -> None:
    """The hooks a pruned model needs beyond its smaller weights; idempotent, so pruning again updates them.

    Families sharing a position bias across layers (T5): every pruned module picks its own heads of it. Decoder
    self-attention left without heads: a phantom head keeps the generation cache length right.
    """
    bias_attr = record["layout"].get("position_bias_attr")
    for path, kept in pruned_paths(record).items():
        if bias_attr:
            _share_bias(model, path, kept, record["num_heads"][path], bias_attr)
        if not kept and path in record["kept_heads"].get("decoder", {}):
            _add_phantom_head(model.get_submodule(path), record["layout"])


def restore_pruned(model: nn.Module, record: dict) -> None:
    """Cut a freshly built (unpruned) model to the shapes of ``record``; loading the weights comes after."""
    for path, kept in pruned_paths(record).items():
        prune_attention(model.get_submodule(path), kept, record["layout"])
    install_runtime(model, record)


@functools.cache
def pruned_model_class(base: type) -> type:
    """``base`` (a transformers seq2seq class) whose constructor gives the pruned shapes of ``config.gatedprune``."""

    class GatedPruned(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if getattr(config, CONFIG_KEY, None) is not None:  # without a plan, it is just `base`
                restore_pruned(self, getattr(config, CONFIG_KEY))

    GatedPruned.__name__ = GatedPruned.__qualname__ = f"GatedPruned{base.__name__}"
    GatedPruned.__doc__ = f"{base.__name__} with the attention heads that ``config.{CONFIG_KEY}`` keeps."
    return GatedPruned


# The exporter appends the line that names the class of the exported family, e.g.
# GatedPrunedMarianMTModel = pruned_model_class(transformers.MarianMTModel)
