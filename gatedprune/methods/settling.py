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

``settle_widths_at`` (a cost budget's) then decides every gate as the fill would ship it at that step (the most open
structures whose cost fits the target, ``StructureCosts.within``) and holds it, so the rest of the gated phase trains
the model that ships (each held gate sampled at log_alpha +-10, as a settled layer is): its deterministic gates cost
what the export costs, and the export is the model validated. docs/gates.md 0l: at 0.55 the gated phases ended 2-3%
under the target, 32-42% of what a plan may spend beyond its one emptied decoder layer (0.512 of the dense
latency), and filling a gated model's export up to the target scored 1.6-1.8 validation BLEU below the gated model.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from gatedprune.costs.linear import shown_fraction
from gatedprune.structures.head_gates import HeadGates
from gatedprune.structures.kinds import KINDS, LAYER_KINDS, layer_kind

if TYPE_CHECKING:
    from gatedprune.methods.budget import CostBudget

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


def check_widths(widths_at, layers_at) -> None:
    """Refuse, in one line, a step to settle every gate at that the run cannot use (before anything runs)."""
    if widths_at is None:
        return
    if isinstance(widths_at, bool) or not isinstance(widths_at, int) or widths_at < 1:
        raise ValueError(f"pruning.settle_widths_at={widths_at}; allowed: null or an integer >= 1 (a gated step)")
    if layers_at is not None and widths_at < layers_at:
        raise ValueError(f"pruning.settle_widths_at={widths_at} is before pruning.settle_layers_at={layers_at}: the "
                         f"widths are decided around settled layers; allowed: an integer >= {layers_at}, or null")


def check_inside(names: dict, steps: int, max_steps: int, start_step: int) -> None:
    """Refuse a settling step (``names``: {option: step or None}) that is not inside the gated phase of ``steps``."""
    for name, at in names.items():
        if at is not None and at >= steps:
            raise ValueError(f"pruning.{name}={at} is not inside the gated phase ({steps} steps: trainer.max_steps="
                             f"{max_steps} - pruning.start_step={start_step}); allowed: an integer in [1, "
                             f"{steps - 1}], or null, or a longer gated phase (gated_steps)")


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
    costs = gates.costs[budget.unit]
    least = costs.floor_with(gates, depth)
    if least > budget.target:
        shown = shown_fraction(least)
        fits = deepest_fitting(depth, lambda d: costs.floor_with(gates, d) <= budget.target)
        if fits:
            fewer = f"{fits} (the deepest that fits)"
        else:  # one layer in each named stack is already over the target
            one_each = shown_fraction(costs.floor_with(gates, dict.fromkeys(depth, 1)))
            fewer = f"fewer stacks named (one layer in each keeps at least {one_each})"
        raise ValueError(f"pruning.settle_depth={dict(depth)} keeps at least {shown} of the dense model's "
                         f"{budget.WHAT[budget.unit]} (those layers alone, every other gated structure removed), "
                         f"above pruning.target_{budget.unit}={budget.target}; allowed: {fewer}, or a target of "
                         f"at least {shown}")


def deepest_fitting(depth: dict[str, int], fits) -> dict[str, int] | None:
    """Of the depths with at most ``depth``'s layers in each of its stacks (at least one), the one with the most
    layers in all that ``fits`` (a predicate on {stack: layers}); ties go to the deeper first stack. None: none fits."""
    stacks = list(depth)
    shapes = [dict(zip(stacks, counts)) for counts in itertools.product(*(range(depth[s], 0, -1) for s in stacks))]
    return max((d for d in shapes if fits(d)), key=lambda d: sum(d.values()), default=None)


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


def settle_widths(gates: HeadGates, settle_at: int | None, gated_step: int, budget: CostBudget) -> None:
    """At gated step ``settle_at`` (after the layers, when both settle then), every gate is decided as the fill keeps
    it (the most open structures whose cost fits ``budget``'s target, as the export counts it: ``kept_allowed``) and
    held; a resumed run finds them in its checkpoint. A layer settled open whose fixed cost the fill cannot pay is
    dropped with its content, and said."""
    if settle_at is None or gated_step != settle_at:
        return
    mask = gates.plan_mask(budget.unit, budget.kept_allowed, note=False)
    for path, structure, kept in zip(gates.paths, gates.structures, mask):
        if structure == "layer" and gates.settled.get(path, [0.0])[0] > 0 and not kept[0]:
            print(f"note: the fill of the target drops {path}, settled open: it does not fit with the rest")
    gates.hold_(dict(zip(gates.paths, mask)))
    kept = budget.kept_fraction(torch.cat(gates.plan_mask("binary", note=False)))
    print(f"gated step {gated_step}: note: every gate is settled and held as the fill keeps it, "
          f"{kept:.3f} of the dense model's {budget.unit} (target {budget.target})")
