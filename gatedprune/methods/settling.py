"""Layers decided apart from widths (NASH, Ko et al. 2023): at one gated step the layer gates are decided and held,
and the widths meet the budget around layers that no longer move.

How many layers a stack keeps is, by default, what its gates expect (the expected number of open layer gates,
rounded: CoFiPruning's deterministic mask). ``settle_depth`` sets it by a rule instead ({stack: layers}), the
gates choosing every width. docs/gates.md 0f found the rounded count the same at every
seed and both targets (one decoder layer), where random structures kept two narrower decoder layers at 0.67 and
scored higher; a depth given is how that choice is tested, and how a user fixes it.

Which layers a settled stack keeps is its most open layer gates (``settle_keep: open``), or its first layers from
the input (``bottom``: Sajjad et al. 2020's top-layer dropping, which layers by a rule and only the widths by the
gates; a stack ``settle_depth`` does not name keeps its expected count, so settled early, while the gates are still
open, nearly all of it). docs/gates.md 0i: the gates kept the top decoder layers at every seed and both targets,
where the random structures that scored highest at 0.67 kept layers 0 and 1.
"""

from __future__ import annotations

from gatedprune.costs.linear import shown_fraction
from gatedprune.structures.head_gates import HeadGates
from gatedprune.structures.kinds import KINDS, LAYER_KINDS, layer_kind

STACKS = tuple(KINDS[kind].stack for kind in LAYER_KINDS)
KEEP = ("open", "bottom")  # which layers a settled stack keeps: its most open gates, or its first layers


def check_settling(settle_at, depth, kinds, keep: str = "open") -> None:
    """Refuse, in one line, a settling step, a depth or a rule the run cannot use (before anything runs)."""
    if keep not in KEEP:
        raise ValueError(f"pruning.settle_keep={keep!r}; allowed: {', '.join(KEEP)}")
    if keep != "open" and settle_at is None:
        raise ValueError(f"pruning.settle_keep={keep} says which layers are kept when the layer gates settle, and "
                         "pruning.settle_layers_at is null; allowed: with settle_layers_at, or settle_keep open")
    if settle_at is not None:
        if isinstance(settle_at, bool) or not isinstance(settle_at, int) or settle_at < 1:
            raise ValueError(f"pruning.settle_layers_at={settle_at}; allowed: null or an integer >= 1 (a gated step)")
        if not any(kind in LAYER_KINDS for kind in kinds):
            raise ValueError(f"pruning.settle_layers_at={settle_at} settles the layer gates, and pruning.kinds="
                             f"{list(kinds)} has none; allowed: with encoder_layer or decoder_layer in pruning.kinds, "
                             "or null")
    if depth is None:
        return
    if not hasattr(depth, "items"):
        raise ValueError(f"pruning.settle_depth={depth!r}; allowed: null or {{stack: layers}}, e.g. {{decoder: 2}}")
    if settle_at is None:
        raise ValueError(f"pruning.settle_depth={dict(depth)} is the depth kept when the layer gates settle, and "
                         "pruning.settle_layers_at is null; allowed: with settle_layers_at, or settle_depth null")
    for stack, layers in depth.items():
        if stack not in STACKS or layer_kind(stack) not in kinds:
            gated = [KINDS[k].stack for k in LAYER_KINDS if k in kinds]
            raise ValueError(f"pruning.settle_depth has {stack!r}; allowed: a stack whose layers are gated "
                             f"({', '.join(gated)})")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"pruning.settle_depth.{stack}={layers!r}; allowed: an integer >= 1 (layers kept)")


def check_depth(depth, gates: HeadGates) -> None:
    """Refuse a depth deeper than the model (known once the gates are attached)."""
    for stack, layers in (depth or {}).items():
        have = gates.kinds.count(layer_kind(stack))
        if layers > have:
            raise ValueError(f"pruning.settle_depth.{stack}={layers}; allowed: an integer in [1, {have}] (the "
                             f"model's {stack} layers)")


def check_depth_fits(depth, gates: HeadGates, budget) -> None:
    """Refuse a depth whose layers alone, every other gated structure removed, cost more than a cost budget's target
    (``budget``: a ``CostBudget``): the widths would close and the run would still miss it."""
    if not depth:
        return
    least = gates.costs[budget.unit].floor_with(gates, depth)
    if least > budget.target:
        shown = shown_fraction(least)
        raise ValueError(f"pruning.settle_depth={dict(depth)} keeps at least {shown} of the dense model's "
                         f"{budget.WHAT[budget.unit]} (those layers alone, every other gated structure removed), "
                         f"above pruning.target_{budget.unit}={budget.target}; allowed: fewer layers, or a target of "
                         f"at least {shown}")


def settle_layers(gates: HeadGates, settle_at: int | None, depth, gated_step: int, keep: str = "open") -> None:
    """Before each gated step: from ``settle_at`` on, the layer gates are decided (once; a resumed run finds them
    settled in its checkpoint)."""
    if settle_at is None or gated_step < settle_at:
        return
    layers = [kind for kind in LAYER_KINDS if kind in gates.kinds]
    if not all(path in gates.settled for path, kind in zip(gates.paths, gates.kinds) if kind in layers):
        counts = {**{k: n for k, n in gates.expected_counts().items() if k in layers},
                  **{layer_kind(stack): n for stack, n in (depth or {}).items()}}
        if keep == "bottom":  # the first n layers made the most open, so the top-n choice below keeps them
            gates.fix_({gates.layers_paths[kind]: list(range(n)) for kind, n in counts.items()})
        print(f"gated step {gated_step}: ", end="")
        gates.settle_(layers, counts=counts)
