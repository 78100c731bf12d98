"""Where the feed-forward blocks of a model live, and the gate of their intermediate units.

A feed-forward block is one or two input projections (two for gated FFNs: T5 v1.1 ``wi_0``/``wi_1``, llama-like
``gate_proj``/``up_proj``), an activation, and an output projection. Unit u is row u of every input projection
and column u of the output projection, so gating the output projection's input feature u gates the unit, and
cutting those rows and that column removes it exactly. ``FFN_LAYOUTS`` and ``CONTAINERS`` are data: a family adds
a row. Mixture-of-experts blocks are refused: a router still sends tokens to an expert whose units are gated off.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gatedprune.surgery.pruned_modeling import attr


@dataclass(frozen=True)
class FFNLayout:
    name: str
    inputs: tuple[str, ...]  # input projections (rows = units), names inside the container
    output: str  # output projection (columns = units)


FFN_LAYOUTS = (
    FFNLayout("fc", ("fc1",), "fc2"),  # BART, mBART, Marian, Pegasus, M2M100, Whisper, ...
    FFNLayout("t5 gated", ("wi_0", "wi_1"), "wo"),  # T5 v1.1, mT5, UMT5
    FFNLayout("t5", ("wi",), "wo"),
    FFNLayout("llama gated", ("gate_proj", "up_proj"), "down_proj"),  # T5Gemma
    FFNLayout("bert", ("intermediate.dense",), "output.dense"),
)
# where the block sits inside one layer ("" = on the layer itself)
CONTAINERS = ("", "mlp", "ffn", "layer.1.DenseReluDense", "layer.2.DenseReluDense")
MOE_NAMES = ("router", "experts")  # a module of these names inside a layer: a mixture of experts


class FFNError(ValueError):
    """The feed-forward blocks of a stack cannot be gated; the message is one line."""


@dataclass(frozen=True)
class FFNSite:
    """The feed-forward block of one layer: ``path`` is its output projection (as in ``named_modules``)."""

    path: str
    kind: str
    layer: int
    container: nn.Module
    layout: FFNLayout
    container_path: str  # inside the layer ("" = the layer itself)

    @property
    def width(self) -> int:
        return self.projection_out().in_features

    @property
    def num_units(self) -> int:
        return self.width

    def projection_out(self) -> nn.Linear:
        return attr(self.container, self.layout.output)

    def projections_in(self) -> list[nn.Linear]:
        return [attr(self.container, name) for name in self.layout.inputs]

    def unit_parameters(self) -> int:
        """Parameters one unit owns: its row (and bias) of every input projection, its output-projection column."""
        return sum(p.in_features + (p.bias is not None) for p in self.projections_in()) + self.projection_out().out_features

    def attach(self, value):
        """Gate the units: the output projection's input (B, T, F) times ``value(training)`` (F,)."""

        def hook(out_proj: nn.Module, args: tuple) -> tuple:
            (x, *rest) = args  # (B, T, F)
            return (x * value(out_proj.training).to(x.dtype), *rest)

        return [self.projection_out().register_forward_pre_hook(hook)]


def find_ffn(layer: nn.Module) -> tuple[str, FFNLayout] | None:
    """(container path, layout) of the feed-forward block of ``layer``: the first whose projections exist and fit."""
    for container_path in CONTAINERS:
        try:
            container = layer.get_submodule(container_path) if container_path else layer
        except AttributeError:
            continue
        for layout in FFN_LAYOUTS:
            out = attr(container, layout.output)
            ins = [attr(container, name) for name in layout.inputs]
            if isinstance(out, nn.Linear) and all(isinstance(p, nn.Linear) and p.out_features == out.in_features
                                                   for p in ins):
                return container_path, layout
    return None


def is_moe(layer: nn.Module) -> bool:
    return any(name.rpartition(".")[2] in MOE_NAMES for name, _ in layer.named_modules())


def ffn_sites(model: nn.Module, stack: str, layers_path: str, kind: str) -> list[FFNSite]:
    """The feed-forward block of every layer of a stack; ``FFNError`` when a stack has none the table describes,
    or a mixture of experts."""
    layers = model.get_submodule(layers_path)
    name = type(model).__name__
    if any(is_moe(layer) for layer in layers):
        raise FFNError(f"{kind} of {name}: its {stack} layers hold a mixture of experts (a router still sends tokens "
                       f"to an expert whose units are gated off, so units cannot be cut out exactly); allowed: the "
                       f"attention and layer kinds")
    sites = []
    for i, layer in enumerate(layers):
        found = find_ffn(layer)
        if found is None:
            raise FFNError(f"{kind} of {name}: {stack} layer {i} ({type(layer).__name__}) has no feed-forward block "
                           f"of a known layout ({', '.join(l.name for l in FFN_LAYOUTS)})")
        container_path, layout = found
        container = layer.get_submodule(container_path) if container_path else layer
        inside = f"{container_path}.{layout.output}" if container_path else layout.output
        sites.append(FFNSite(f"{layers_path}.{i}.{inside}", kind, i, container, layout, container_path))
    return sites


def ffn_record(site: FFNSite) -> dict:
    """What the runtime needs to cut a stack's blocks again (``config.gatedprune.layout[stack]["ffn"]``)."""
    return {"container": site.container_path, "inputs": list(site.layout.inputs), "output": site.layout.output}

