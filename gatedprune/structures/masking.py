"""A plan applied by gates instead of cuts: every gate fixed open or closed, the function the cut model must compute.

The methods that score a trained model measure plans this way, and the exporter's reference is a gated model too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from gatedprune.structures.adapters import probe
from gatedprune.structures.head_gates import HeadGates, attach_gates
from gatedprune.structures.kinds import ATTENTION_KINDS, layer_kind
from gatedprune.surgery.cut import Plan, check_plan, model_ffn_sites


def plan_kinds(model: nn.Module, plan: Plan) -> tuple[str, ...]:
    """The kinds whose gates a plan sets: every attention kind, and the unit and layer kinds it names."""
    kinds = set(ATTENTION_KINDS)
    kinds |= {site.kind for site in model_ffn_sites(model) if site.path in plan}
    kinds |= {layer_kind(stack) for stack, path in probe(model).layers.items() if path in plan}
    return tuple(sorted(kinds))


@contextmanager
def masked_heads(model: nn.Module, plan: Plan) -> Iterator[HeadGates]:
    """``model`` gated with every gate fixed by ``plan``: open for what it keeps, closed for the rest.

    This is the function ``prune_heads(model, plan)`` must compute; the gates go when the block ends.
    """
    plan = check_plan(model, plan)
    gates = attach_gates(model, plan_kinds(model, plan)).fix_(plan).set_mode("binary")
    try:
        yield gates
    finally:
        gates.remove()
