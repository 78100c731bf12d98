"""Every prunable structure of a model, of the kinds asked for: attention modules (heads), feed-forward blocks
(units), layers. Each site has a ``path``, ``kind``, ``layer``, ``num_units``, ``unit_parameters()`` and
``attach(value)``, which hooks its gate in; the gates and the cost code are generic over them."""

from __future__ import annotations

from torch import nn

from gatedprune.structures.adapters import attention_sites, probe
from gatedprune.structures.ffn import ffn_sites
from gatedprune.structures.kinds import ATTENTION_KINDS, KINDS, check_kinds
from gatedprune.structures.layers import layer_sites


def structure_sites(model: nn.Module, kinds) -> list:
    """The sites of ``kinds``, in (kind, layer) order: attention kinds first, as before, so head gates keep their
    place in a checkpoint written before the other kinds existed."""
    kinds = check_kinds(kinds)
    sites = list(attention_sites(model, [k for k in kinds if k in ATTENTION_KINDS])) if any(
        k in ATTENTION_KINDS for k in kinds) else []
    structure = probe(model)
    for kind in kinds:
        spec = KINDS[kind]
        if spec.structure == "units":
            sites += ffn_sites(model, spec.stack, structure.layers[spec.stack], kind)
        elif spec.structure == "layer":
            sites += layer_sites(model, structure.layers[spec.stack], kind)
    return sites


def stack_layers(model: nn.Module) -> dict[str, str]:
    """``{stack: path of its ModuleList of layers}``."""
    return dict(probe(model).layers)
