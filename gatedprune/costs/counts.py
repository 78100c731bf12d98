"""The structures of a model counted per kind, in total and per layer: every cost unit here is linear in them.

Counted on the model itself (not on a plan), so a physically pruned model and the gated model it came from are
costed by one rule. A kind the family does not have (a mixture of experts' FFN) counts nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from torch import nn

from gatedprune.structures.kinds import ALL_KINDS, KINDS
from gatedprune.structures.sites import structure_sites

Layer = tuple[str, int]  # (stack, layer index)


def kind_sites(model: nn.Module) -> dict[str, list]:
    """``{kind: its sites}`` for every kind the model can be gated on."""
    sites = {}
    for kind in ALL_KINDS:
        try:
            sites[kind] = structure_sites(model, [kind])
        except ValueError:  # the family has no such structure (a mixture of experts' units or layers)
            continue
    return sites


def layer_counts(model: nn.Module) -> dict[Layer, Counter]:
    """``{(stack, layer): {kind: structures}}``: heads of each attention kind, FFN units, and 1 for the layer."""
    counts: dict[Layer, Counter] = defaultdict(Counter)
    for kind, sites in kind_sites(model).items():
        for site in sites:
            counts[(KINDS[kind].stack, site.layer)][kind] += site.num_units
    return dict(counts)


def features(model: nn.Module) -> dict[str, int]:
    """Structures per kind in the whole model (layer kinds: layers), every kind present (0 where none)."""
    total = Counter()
    for counts in layer_counts(model).values():
        total.update(counts)
    return {kind: total[kind] for kind in ALL_KINDS}



def empty_sites(model: nn.Module) -> dict[str, int]:
    """Attention modules left with no head, per kind: each still runs one phantom head's attention (QK^T, AV over
    zero projections: ``surgery.pruned_modeling.PhantomHead``), which FLOPs count."""
    return {kind: sum(1 for s in sites if not s.num_units) for kind, sites in kind_sites(model).items()
            if KINDS[kind].structure == "heads"}
