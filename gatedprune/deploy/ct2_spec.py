"""A CTranslate2 ``TransformerSpec`` built from the weights of a PyTorch seq2seq model, pruned or not.

CTranslate2 takes any number of layers per stack and any FFN width per layer, but one head count per stack
(the decoder's covers both its self- and cross-attention), with an explicit ``head_dim``. So a layer with fewer
heads than its stack's largest is padded with zero heads: zero query/key/value rows and zero output-projection
columns, which attend uniformly to a value of zero and add nothing (exact). An FFN left with no units gets one
zero unit (``spec.optimize`` refuses a zero-width matrix): act(0) = 0 and a zero output column add nothing.

The attention and FFN modules are found through gatedprune's layout description (``structure_sites``); what
CTranslate2 reads besides them (norms, embeddings, positions, flags) is a row of ``CT2_LAYOUTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from gatedprune.structures.adapters import probe
from gatedprune.structures.sites import structure_sites
from gatedprune.surgery.pruned_modeling import CONFIG_KEY, attr

ACTIVATIONS = {"gelu": "GELU", "gelu_python": "GELU", "gelu_new": "GELUTanh", "gelu_fast": "GELUTanh",
               "gelu_pytorch_tanh": "GELUTanh", "quick_gelu": "GELUSigmoid", "relu": "RELU", "silu": "SWISH",
               "swish": "SWISH"}


@dataclass(frozen=True)
class CT2Layout:
    """Where a family keeps what CTranslate2 reads besides attention and FFN projections (paths in one layer, or
    in one stack); ``{stack}`` in a name is the stack's own part."""

    stacks: dict  # stack -> module path
    self_norm: str
    cross_norm: str
    ffn_norm: dict  # stack -> path in a layer
    final_norm: str | None  # on the stack; present: pre-norm
    embedding_norm: str | None
    activation: str  # config field naming the activation
    relative_bias: str | None  # T5: the attention in the first layer holding the stack's relative position bias (then
    # no position table, unscaled queries, RMS norms)
    vocabulary_head: str = "lm_head"
    output_scale: str | None = None  # config flag: the decoder output is scaled by d_model ** -0.5 (T5, not mT5)


BART_LIKE = CT2Layout(
    stacks={"encoder": "model.encoder", "decoder": "model.decoder"}, self_norm="self_attn_layer_norm",
    cross_norm="encoder_attn_layer_norm", ffn_norm={"encoder": "final_layer_norm", "decoder": "final_layer_norm"},
    final_norm="layer_norm", embedding_norm="layernorm_embedding", activation="activation_function",
    relative_bias=None,
)
T5_LIKE = CT2Layout(
    stacks={"encoder": "encoder", "decoder": "decoder"}, self_norm="layer.0.layer_norm", cross_norm="layer.1.layer_norm",
    ffn_norm={"encoder": "layer.1.layer_norm", "decoder": "layer.2.layer_norm"}, final_norm="final_layer_norm",
    embedding_norm=None, activation="dense_act_fn", relative_bias="layer.0.SelfAttention",
    output_scale="scale_decoder_outputs",
)
CT2_LAYOUTS = {"bart": BART_LIKE, "mbart": BART_LIKE, "marian": BART_LIKE, "m2m_100": BART_LIKE, "t5": T5_LIKE,
               "mt5": replace(T5_LIKE, output_scale=None)}


def _rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` with zero rows appended up to ``rows``.  # (R, ...) -> (rows, ...)"""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _columns(weight: torch.Tensor, columns: int) -> torch.Tensor:
    return _rows(weight.T, columns).T.contiguous()


def _module(parent: nn.Module, path: str | None) -> nn.Module | None:
    return attr(parent, path) if path else None


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A copy: ``spec.optimize`` quantizes its variables in place, which must not reach the model's weights."""
    return tensor.detach().clone().contiguous()


def _norm(spec, module: nn.Module) -> None:
    spec.gamma = _own(module.weight)
    if not hasattr(spec, "beta"):  # RMS norm: no shift
        return
    spec.beta = _own(module.bias)


def _linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _own(weight)
    if bias is not None:
        spec.bias = _own(bias)


class _Attention:
    """One attention module padded to ``heads`` heads: its projections as CTranslate2 lays them out."""

    def __init__(self, site, heads: int):
        self.site, self.heads, dim = site, heads, site.head_dim
        self.rows = heads * dim

    def projection(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = self.site.projection(name)
        weight, bias = linear.weight.detach(), linear.bias
        if name == "o":  # (D, h * dh) -> (D, H * dh): the padding heads' columns are zero
            return _columns(weight, self.rows), bias
        return _rows(weight, self.rows), None if bias is None else _rows(bias.detach(), self.rows)

    def fill(self, spec, fused_qkv: bool) -> None:
        q, k, v = (self.projection(name) for name in ("q", "k", "v"))
        groups = [[q, k, v]] if fused_qkv else [[q], [k, v]]  # self-attention: one (3HD, D) matrix
        for linear, parts in zip(spec.linear, groups):
            bias = None if parts[0][1] is None else torch.cat([b for _, b in parts])
            _linear(linear, torch.cat([w for w, _ in parts]), bias)
        _linear(spec.linear[-1], *self.projection("o"))


def _stack_heads(attention_sites: list) -> int:
    """The stack's one head count: its largest layer's (one, where every layer lost every head)."""
    return max([site.num_heads for site in attention_sites] + [1])


def _kept_slots(model: nn.Module, site) -> list[int]:
    """The original head numbers a T5 layer still has (the shared bias table is indexed by them)."""
    record = getattr(model.config, CONFIG_KEY, None) or {}
    return list(record.get("slots", {}).get(site.path, range(site.num_heads)))


def _relative_bias(model: nn.Module, first_layer: str, site, heads: int, owner: str) -> tuple[torch.Tensor, int]:
    """The layer's own columns of its stack's shared relative position bias, zero-padded.  # (buckets, heads)"""
    first = attr(model.get_submodule(first_layer), owner)
    table = first.relative_attention_bias.weight.detach()  # (buckets, H before pruning)
    own = table[:, _kept_slots(model, site)]  # (buckets, h)
    return _columns(own, heads), int(first.relative_attention_max_distance)


def _ffn(spec, site) -> None:
    """Inputs (the first activated, a second one ungated: T5 v1.1's GLU), output; one zero unit if none is left."""
    names = ("linear_0", "linear_0_noact")
    width = max(site.width, 1)
    for name, linear in zip(names, site.projections_in()):
        bias = None if linear.bias is None else _rows(linear.bias.detach(), width)
        _linear(getattr(spec, name), _rows(linear.weight.detach(), width), bias)
    out = site.projection_out()
    _linear(spec.linear_1, _columns(out.weight.detach(), width), out.bias)


def build_spec(model: nn.Module, tokens: list[str]):
    """The spec of ``model`` with vocabulary ``tokens`` (id order) and the padding it needed:
    ``(spec, {"heads": {stack: n}, "padded_head_slots": {stack: n}, "padded_ffn_layers": {stack: n}})``."""
    from ctranslate2.specs import common_spec, transformer_spec

    layout = CT2_LAYOUTS[model.config.model_type]
    config = model.config
    sites = structure_sites(model, ["encoder", "decoder", "cross", "encoder_ffn", "decoder_ffn"])
    by_kind = {kind: [s for s in sites if s.kind == kind] for kind in ("encoder", "decoder", "cross", "encoder_ffn",
                                                                       "decoder_ffn")}
    heads = {"encoder": _stack_heads(by_kind["encoder"]), "decoder": _stack_heads(by_kind["decoder"] + by_kind["cross"])}
    encoder_module, decoder_module = (model.get_submodule(layout.stacks[s]) for s in ("encoder", "decoder"))
    pre_norm = is_pre_norm(model)
    t5 = layout.relative_bias is not None
    options = dict(pre_norm=pre_norm, activation=getattr(common_spec.Activation,
                                                         ACTIVATIONS[getattr(config, layout.activation)]),
                   layernorm_embedding=_module(encoder_module, layout.embedding_norm) is not None,
                   relative_attention_bias=t5, rms_norm=t5,  # a gated FFN (T5 v1.1) has two input projections
                   ffn_glu=any(len(s.layout.inputs) == 2 for s in by_kind["encoder_ffn"] + by_kind["decoder_ffn"]))
    # CTranslate2 loads no stack without layers: an encoder left with none gets one that adds nothing (pre-norm)
    encoder = transformer_spec.TransformerEncoderSpec(
        max(len(by_kind["encoder"]), 1), heads["encoder"], head_dim=_head_dim(by_kind["encoder"], config), **options)
    decoder = transformer_spec.TransformerDecoderSpec(
        len(by_kind["decoder"]), heads["decoder"], head_dim=_head_dim(by_kind["decoder"], config), **options)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    padded = {"heads": heads, "padded_head_slots": {}, "padded_ffn_layers": {}}
    for stack, stack_spec, module in (("encoder", encoder, encoder_module), ("decoder", decoder, decoder_module)):
        _fill_stack(model, stack, stack_spec, module, by_kind, heads[stack], layout)
        attention = by_kind[stack] + (by_kind["cross"] if stack == "decoder" else [])
        padded["padded_head_slots"][stack] = sum(heads[stack] - s.num_heads for s in attention)
        padded["padded_ffn_layers"][stack] = sum(s.width == 0 for s in by_kind[f"{stack}_ffn"])
    head = model.get_submodule(layout.vocabulary_head)
    bias = getattr(model, "final_logits_bias", None)
    _linear(decoder.projection, head.weight, None if bias is None else bias.reshape(-1))
    if layout.output_scale and getattr(config, layout.output_scale, False):
        decoder.scale_outputs = config.d_model ** -0.5
    _set_config(spec, model, tokens, layout)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    return spec, padded


def is_pre_norm(model: nn.Module) -> bool:
    """Pre-norm families end each stack with a norm (and a layer whose outputs are zero is then the identity)."""
    layout = CT2_LAYOUTS[model.config.model_type]
    stack = model.get_submodule(layout.stacks["encoder"])
    return layout.final_norm is not None and _module(stack, layout.final_norm) is not None


def _identity_layer(spec, dim: int, head_dim: int, heads: int, biases: bool) -> None:
    """A pre-norm layer that adds nothing: zero attention and FFN outputs."""
    zeros = lambda *shape: torch.zeros(*shape)  # noqa: E731
    bias = (lambda n: zeros(n)) if biases else (lambda n: None)
    inner = heads * head_dim
    _linear(spec.self_attention.linear[0], zeros(3 * inner, dim), bias(3 * inner))
    _linear(spec.self_attention.linear[1], zeros(dim, inner), bias(dim))
    _linear(spec.ffn.linear_0, zeros(1, dim), bias(1))
    if hasattr(spec.ffn, "linear_0_noact"):
        _linear(spec.ffn.linear_0_noact, zeros(1, dim), bias(1))
    _linear(spec.ffn.linear_1, zeros(dim, 1), bias(dim))
    for norm in (spec.self_attention.layer_norm, spec.ffn.layer_norm):
        norm.gamma = torch.ones(dim)
        if hasattr(norm, "beta"):
            norm.beta = torch.zeros(dim)


def _head_dim(sites: list, config) -> int:
    if sites:
        return sites[0].head_dim
    return getattr(config, "d_kv", None) or config.d_model // config.encoder_attention_heads


def _fill_stack(model, stack: str, spec, module: nn.Module, by_kind: dict, heads: int, layout: CT2Layout) -> None:
    embed = module.embed_tokens
    (spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings).weight = _own(embed.weight)
    if layout.relative_bias:
        spec.scale_embeddings = False
    else:  # BART-likes scale in the embedding module (v5) or on the stack (Marian)
        spec.scale_embeddings = float(getattr(embed, "embed_scale", None) or getattr(module, "embed_scale", 1.0))
        positions = module.embed_positions
        table = getattr(positions, "weight", None)
        if table is not None:  # a learned (BART) or fixed (Marian) table: position t is row offset + t
            start = getattr(positions, "offset", 0)
        else:  # M2M100's sinusoids count positions from padding_idx + 1
            table, start = positions.weights, positions.padding_idx + 1
        spec.position_encodings.encodings = _own(table[start:])
    if hasattr(spec, "layer_norm"):
        _norm(spec.layer_norm, _module(module, layout.final_norm))
    if hasattr(spec, "layernorm_embedding"):
        _norm(spec.layernorm_embedding, _module(module, layout.embedding_norm))
    layers_path = probe(model).layers[stack]
    cross = {s.layer: s for s in by_kind["cross"]} if stack == "decoder" else {}
    ffn = {s.layer: s for s in by_kind[f"{stack}_ffn"]}
    if not by_kind[stack]:
        dim = module.embed_tokens.weight.shape[1]
        _identity_layer(spec.layer[0], dim, int(spec.layer[0].self_attention.head_dim), heads,
                        biases=not layout.relative_bias)
        if layout.relative_bias:
            spec.layer[0].self_attention.queries_scale = 1.0
            config = model.config
            spec.layer[0].self_attention.relative_attention_bias = torch.zeros(config.relative_attention_num_buckets,
                                                                               heads)
            spec.layer[0].self_attention.relative_attention_max_distance = np.int32(
                config.relative_attention_max_distance)
    for layer_spec, site in zip(spec.layer, by_kind[stack]):
        layer = model.get_submodule(f"{layers_path}.{site.layer}")
        _Attention(site, heads).fill(layer_spec.self_attention, fused_qkv=True)
        _norm(layer_spec.self_attention.layer_norm, attr(layer, layout.self_norm))
        if layout.relative_bias:
            layer_spec.self_attention.queries_scale = 1.0
            table, distance = _relative_bias(model, f"{layers_path}.0", site, heads, layout.relative_bias)
            layer_spec.self_attention.relative_attention_bias = table
            layer_spec.self_attention.relative_attention_max_distance = np.int32(distance)
        if site.layer in cross:
            _Attention(cross[site.layer], heads).fill(layer_spec.attention, fused_qkv=False)
            _norm(layer_spec.attention.layer_norm, attr(layer, layout.cross_norm))
            if layout.relative_bias:
                layer_spec.attention.queries_scale = 1.0
        _ffn(layer_spec.ffn, ffn[site.layer])
        _norm(layer_spec.ffn.layer_norm, attr(layer, layout.ffn_norm[stack]))


def _token(tokens: list[str], token_id: int | None) -> str | None:
    return None if token_id is None else tokens[token_id]


def _set_config(spec, model: nn.Module, tokens: list[str], layout: CT2Layout) -> None:
    config, generation = model.config, model.generation_config
    start = generation.decoder_start_token_id
    start = config.decoder_start_token_id if start is None else start
    unk = getattr(config, "unk_token_id", None)
    spec.config.decoder_start_token = _token(tokens, start)
    spec.config.eos_token = _token(tokens, generation.eos_token_id if isinstance(generation.eos_token_id, int)
                                   else config.eos_token_id)
    spec.config.bos_token = _token(tokens, getattr(config, "bos_token_id", None)) or spec.config.decoder_start_token
    spec.config.unk_token = _token(tokens, unk) or spec.config.unk_token
    norm = _module(model.get_submodule(layout.stacks["decoder"]), layout.final_norm)
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
    if eps is None:  # post-norm families: read a layer's norm
        eps = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    spec.config.layer_norm_epsilon = float(eps)
