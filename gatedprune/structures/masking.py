"""A plan applied by gates instead of cuts: every gate fixed open or closed, the function the cut model must compute.

The methods that score a trained model measure plans this way, and the exporter's reference is a gated model too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from gatedprune.structures.head_gates import HeadGates, attach_gates
from gatedprune.surgery.cut import Plan, check_plan


@contextmanager
def masked_heads(model: nn.Module, plan: Plan) -> Iterator[HeadGates]:
    """``model`` gated with every gate fixed by ``plan``: open for kept heads, closed for the others.

    This is the function ``prune_heads(model, plan)`` must compute; the gates go when the block ends.
    """
    plan = check_plan(model, plan)
    gates = attach_gates(model).fix_(plan).set_mode("binary")
    try:
        yield gates
    finally:
        gates.remove()
