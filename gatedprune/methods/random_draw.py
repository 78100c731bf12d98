"""Random plans over every gated structure at a parameter budget: ``pruning=random`` with a feed-forward or layer kind.

A budget is a fraction of the model's non-embedding parameters kept at most, as ``pruning=l0_budget``'s
``target_params``, so a random level and a budgeted gated run of the same fraction compare like for like. What a plan
keeps is measured on the model (``gatedprune.surgery.cut.removed_parameters``), not taken from the fill's own sums.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from gatedprune.surgery.cut import removed_parameters

Plan = dict[str, list[int]]


@dataclass
class Draw:
    """One budget's plan, what it keeps, and the numbers a level reports."""

    fraction: float
    plan: Plan
    heads: list[tuple[str, int]]  # kept heads, outside dropped layers
    heads_kept: int
    info: dict


def param_fractions(spec) -> list[float]:
    """Parameter budgets, largest first: each a fraction in (0, 1) of the non-embedding parameters kept."""
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in values):
        raise ValueError(f"pruning.params={values if isinstance(spec, (list, tuple)) else spec!r}; allowed: one or "
                         "more fractions in (0, 1) of the non-embedding parameters kept")
    if len(set(values)) < len(values):  # a level asked for twice is a typo more often than not: never merged quietly
        raise ValueError(f"pruning.params={values} names a budget twice; allowed: distinct fractions")
    return sorted(values, reverse=True)


def _starts(gates) -> list[int]:
    """Where each site's gates begin in the flat order of ``gates.log_alpha()``."""
    return [0, *itertools.accumulate(gate.num_heads for gate in gates.gates)][:-1]


def param_floor(gates, model) -> int:
    """The fewest non-embedding parameters a drawn plan keeps: every gated structure removed, but the largest decoder
    layer where decoder layers are gated (a decoder keeps one, and any of them may be the one drawn)."""
    total, starts = gates.non_embedding_params, _starts(gates)
    floors = []
    for i in [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"] or [None]:
        keep = torch.zeros(gates.num_gates, dtype=torch.bool)
        if i is not None:
            keep[starts[i]] = True
        floors.append(total - removed_parameters(model, gates.plan(keep=keep, note=False)))
    return max(floors)


def check_floor(gates, model, fractions: list[float]) -> None:
    """Refuse a budget below ``param_floor`` (at set-up, before anything is scored)."""
    total, floor = gates.non_embedding_params, param_floor(gates, model)
    for fraction in fractions:
        if int(fraction * total) < floor:
            least = -(-floor * 10_000 // total) / 10_000  # rounded up: the value shown is allowed
            raise ValueError(f"pruning.params={fraction} is below what removing every gated structure reaches ({least} "
                             f"of the non-embedding parameters, a decoder keeping one layer); allowed: fractions in "
                             f"[{least}, 1)")


def draw_within(gates, model, fractions: list[float], seed: int) -> list[Draw]:
    """One random plan per budget in ``fractions``, each keeping at most that fraction of the non-embedding parameters.

    Each gate gets a score uniform in [0, 1) (one draw for every level), and the plan is what ``pruning=l0_budget``'s
    export keeps with those scores in place of log_alpha (``HeadGates.plan("params", ...)``): structures taken
    highest score first, a head or unit never before its layer and only with it, one that does not fit passed over
    for smaller ones after it, until the budget is spent. A decoder keeps at least one layer: its decoder layer drawn
    highest goes first. Where the parameters measured on the model exceed the budget (a T5 position bias that moves
    to a new first layer), the fill is redone with that much less allowed.
    """
    total, starts = gates.non_embedding_params, _starts(gates)
    scores = torch.rand(gates.num_gates, generator=torch.Generator().manual_seed(seed))  # (N,)
    decoder = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
    if decoder:
        scores[starts[max(decoder, key=lambda i: scores[starts[i]].item())]] = 2.0  # above every other score
    draws = []
    for fraction in fractions:
        target = int(fraction * total)
        allowed = target - (total - gates.prunable_params)
        while True:
            plan = _fill(gates, scores, max(allowed, 0))
            kept = total - removed_parameters(model, plan)
            if kept <= target:
                break
            if allowed < 0:  # even the least plan does not fit: check_floor was not asked first
                raise ValueError(f"pruning.params={fraction} is below what removing every gated structure reaches")
            allowed -= kept - target
        dropped = gates.dropped(plan)
        heads = sorted((path, head) for i, path in enumerate(gates.paths) if gates.structures[i] == "heads"
                       and (gates.stacks[i], gates.layers[i]) not in dropped for head in plan[path])
        alive = gates.alive(plan)
        draws.append(Draw(fraction, plan, heads, alive["total"], {
            "seed": seed, "target_params": fraction, "params_kept": kept / total, "non_embedding_params_kept": kept,
            "non_embedding_params": total, "alive": alive}))
    return draws


@torch.no_grad()
def _fill(gates, scores: torch.Tensor, allowed: int) -> Plan:
    """The params rule's plan with ``scores`` (N,) in place of the gates' log_alpha, which are put back after."""
    saved = [gate.log_alpha.detach().clone() for gate in gates.gates]
    try:
        for gate, value in zip(gates.gates, gates.per_site(scores)):
            gate.log_alpha.copy_(value.to(gate.log_alpha.device))
        return gates.plan("params", allowed, note=False)
    finally:
        for gate, value in zip(gates.gates, saved):
            gate.log_alpha.copy_(value)
