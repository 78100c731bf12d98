"""Whole layers as prunable structures: the gate that mixes a layer with the identity.

The gate z of a layer replaces its output y (the hidden states it hands on) with ``x + z * (y - x)``, x being its
input: z = 1 is the layer, z = 0 skips it, whatever the norm placement (post-norm Marian/BART, pre-norm
T5/mBART), so dropping a layer whose gate is closed is exact. Families return the hidden states alone (v5 BART
layers) or first in a tuple (T5 blocks, with the position biases they hand on).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gatedprune.structures.ffn import FFNError, is_moe


@dataclass(frozen=True)
class LayerSite:
    """One layer of a stack: ``path`` is the layer (``<stack layers>.<i>``)."""

    path: str
    kind: str
    layer: int
    module: nn.Module
    layers_path: str  # the stack's ModuleList

    @property
    def num_units(self) -> int:
        return 1

    def unit_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def attach(self, value):
        """Mix the layer's output with its input by ``value(training)`` (1,)."""

        def hook(layer: nn.Module, args: tuple, kwargs: dict, output):
            x = args[0] if args else kwargs["hidden_states"]  # (B, T, d)
            y = output[0] if isinstance(output, tuple) else output
            z = value(layer.training).to(y.dtype)  # (1,)
            mixed = z * y + (1 - z) * x  # = x + z (y - x), and exactly y at z = 1, exactly x at z = 0
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

        return [self.module.register_forward_hook(hook, with_kwargs=True)]


def layer_sites(model: nn.Module, layers_path: str, kind: str) -> list[LayerSite]:
    """Every layer of a stack; ``ValueError`` for a stack holding a mixture of experts, whose sparse layers are
    placed by their index (every k-th): a model rebuilt after a layer goes would put them elsewhere."""
    layers = model.get_submodule(layers_path)
    if any(is_moe(layer) for layer in layers):
        raise FFNError(f"{kind} of {type(model).__name__}: its layers hold a mixture of experts, placed by layer index "
                       f"(every k-th layer is sparse), so a layer cannot go without moving them; allowed: the "
                       f"attention kinds")
    return [LayerSite(f"{layers_path}.{i}", kind, i, layer, layers_path) for i, layer in enumerate(layers)]

