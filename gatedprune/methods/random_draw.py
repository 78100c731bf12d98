"""``pruning=random``: structures drawn at random with a seed, the floor every method must beat.

Heads only (the default kinds, no budget set): keep ``heads`` heads, one permutation of all heads, the first k kept
(nested levels). With a feed-forward or layer kind gated, or a budget set: every gated structure is drawn, one level
per budget, a fraction of the dense model's cost kept at most in one unit, as ``pruning=l0_budget``'s targets:

- ``params``: non-embedding parameters, measured on the model (``gatedprune.surgery.cut.removed_parameters``), not
  taken from the fill's own sums;
- ``flops`` / ``latency``: one ``generate()`` call of ``pruning.workload``, by the formula or the latency fit of
  ``gatedprune.costs`` (the fit cached beside the checkpoint, shared with the gated runs forked from it), so a random
  level and a gated run at the same predicted speed compare like for like.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from gatedprune.costs.build import gate_costs
from gatedprune.costs.linear import shown_fraction
from gatedprune.costs.workload import Workload
from gatedprune.methods.baselines import PlanMethod
from gatedprune.methods.levels import HeadProbe, Level, gate_starts, head_counts, plan_heads
from gatedprune.shipping.export import dense_copy
from gatedprune.structures.kinds import ATTENTION_KINDS
from gatedprune.surgery.cut import prune_heads, removed_parameters

Plan = dict[str, list[int]]
UNITS = ("params", "flops", "latency")
WHAT = {"params": "non-embedding parameters", "flops": "FLOPs", "latency": "predicted latency"}


@dataclass
class Draw:
    """One budget's plan, what it keeps, and the numbers a level reports."""

    fraction: float
    plan: Plan
    heads: list[tuple[str, int]]  # kept heads, outside dropped layers
    heads_kept: int
    info: dict


def budget_fractions(spec, unit: str = "params") -> list[float]:
    """Budgets, largest first: each a fraction in (0, 1) of the dense model's cost in ``unit`` kept."""
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in values):
        raise ValueError(f"pruning.{unit}={values if isinstance(spec, (list, tuple)) else spec!r}; allowed: one or "
                         f"more fractions in (0, 1) of the {WHAT[unit]} kept")
    if len(set(values)) < len(values):  # a level asked for twice is a typo more often than not: never merged quietly
        raise ValueError(f"pruning.{unit}={values} names a budget twice; allowed: distinct fractions")
    return sorted(values, reverse=True)


def param_floor(gates, model) -> int:
    """The fewest non-embedding parameters a drawn plan keeps: every gated structure removed, but the largest decoder
    layer where decoder layers are gated (a decoder keeps one, and any of them may be the one drawn)."""
    total, starts = gates.non_embedding_params, gate_starts(gates)
    floors = []
    for i in [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"] or [None]:
        keep = torch.zeros(gates.num_gates, dtype=torch.bool)
        if i is not None:
            keep[starts[i]] = True
        floors.append(total - removed_parameters(model, gates.plan(keep=keep, note=False)))
    return max(floors)


def check_floor(gates, model, fractions: list[float], unit: str = "params") -> None:
    """Refuse a budget below what removing every gated structure reaches (at set-up, before anything is scored)."""
    if unit == "params":  # a count: a budget holds the parameters int(fraction * total)
        total, floor = gates.non_embedding_params, param_floor(gates, model)
        least = -(-floor * 10_000 // total) / 10_000  # rounded up: the value shown is allowed
        below = [fraction for fraction in fractions if int(fraction * total) < floor]
    else:
        least = shown_fraction(gates.costs[unit].floor)
        below = [fraction for fraction in fractions if fraction < gates.costs[unit].floor]
    if below:
        raise ValueError(f"pruning.{unit}={below[0]} is below what removing every gated structure reaches ({least} of "
                         f"the dense model's {WHAT[unit]}, a decoder keeping one layer); allowed: fractions in "
                         f"[{least}, 1)")


def draw_within(gates, model, fractions: list[float], seed: int, unit: str = "params") -> list[Draw]:
    """One random plan per budget in ``fractions``, each keeping at most that fraction of the dense model's cost.

    Each gate gets a score uniform in [0, 1) (one draw for every level), and the plan is what ``pruning=l0_budget``'s
    export keeps with those scores in place of log_alpha (``HeadGates.plan(unit, ...)``): structures taken highest
    score first, a head or unit never before its layer and only with it, one that does not fit passed over for
    smaller ones after it, until the budget is spent. A decoder keeps at least one layer: its decoder layer drawn
    highest goes first. Parameters: where those measured on the model exceed the budget (a T5 position bias that
    moves to a new first layer), the fill is redone with that much less allowed. FLOPs and latency: the plan's
    predicted cost is that of the model cut to it (``LinearCost.of``).
    """
    total, starts = gates.non_embedding_params, gate_starts(gates)
    scores = torch.rand(gates.num_gates, generator=torch.Generator().manual_seed(seed))  # (N,)
    decoder = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]
    if decoder:
        scores[starts[max(decoder, key=lambda i: scores[starts[i]].item())]] = 2.0  # above every other score
    reference = None if unit == "params" else dense_copy(model)  # the model without its gate hooks
    draws = []
    for fraction in fractions:
        if unit == "params":
            plan, kept = _within_params(gates, model, scores, fraction)
            cost = {}
        else:
            costs = gates.costs[unit]
            plan = _fill(gates, scores, costs.allowed(fraction), unit)
            kept = total - removed_parameters(model, plan)
            cut = copy.deepcopy(reference)
            prune_heads(cut, plan)
            cost = {f"{unit}_kept": costs.linear.of(cut) / costs.total}
        alive = gates.alive(plan)
        draws.append(Draw(fraction, plan, plan_heads(gates, plan), alive["total"], {
            "seed": seed, f"target_{unit}": fraction, **cost, "params_kept": kept / total,
            "non_embedding_params_kept": kept, "non_embedding_params": total, "alive": alive}))
    return draws


def _within_params(gates, model, scores: torch.Tensor, fraction: float) -> tuple[Plan, int]:
    """The fill at a parameter budget, redone with less allowed while the model's own count exceeds it."""
    total = gates.non_embedding_params
    target = int(fraction * total)
    allowed = target - (total - gates.prunable_params)
    while True:
        plan = _fill(gates, scores, max(allowed, 0), "params")
        kept = total - removed_parameters(model, plan)
        if kept <= target:
            return plan, kept
        if allowed < 0:  # even the least plan does not fit: check_floor was not asked first
            raise ValueError(f"pruning.params={fraction} is below what removing every gated structure reaches")
        allowed -= kept - target


@torch.no_grad()
def _fill(gates, scores: torch.Tensor, allowed: float, unit: str) -> Plan:
    """The ``unit`` rule's plan with ``scores`` (N,) in place of the gates' log_alpha, which are put back after."""
    saved = [gate.log_alpha.detach().clone() for gate in gates.gates]
    try:
        for gate, value in zip(gates.gates, gates.per_site(scores)):
            gate.log_alpha.copy_(value.to(gate.log_alpha.device))
        return gates.plan(unit, allowed, note=False)
    finally:
        for gate, value in zip(gates.gates, saved):
            gate.log_alpha.copy_(value)


@dataclass
class Random(PlanMethod):
    """Structures drawn at random with ``seed`` (see the module). Heads only, no budget: keep ``heads`` heads (a
    count, a fraction, or a list of them: one level each). Else one level per budget of the one unit set: ``params``,
    ``flops`` or ``latency`` (a fraction of the dense model's cost kept, or a list of them; ``params`` 0.5 when a
    feed-forward or layer kind is gated and none is set)."""

    name: ClassVar[str] = "random"
    heads_only: ClassVar[bool] = False
    heads: list | int | float | None = None  # null: 0.5 where heads are drawn
    params: list | float | None = None
    flops: list | float | None = None
    latency: list | float | None = None
    # what FLOPs and latency are predicted for, as pruning=l0_budget's (gatedprune.costs.workload.Workload)
    workload: dict = field(default_factory=lambda: asdict(Workload()))
    cost_dir: str | None = None  # where a latency fit is cached (the run's checkpoints) when none is found
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        budgets = {unit: getattr(self, unit) for unit in UNITS if getattr(self, unit) is not None}
        if len(budgets) > 1:
            listed = " and ".join(f"pruning.{unit}={value}" for unit, value in budgets.items())
            raise ValueError(f"{listed}: random draws at one cost; allowed: one of them, the others null")
        others = [kind for kind in self.kinds if kind not in ATTENTION_KINDS]
        if self.heads is not None and (others or budgets):
            why = (f"pruning.kinds names {', '.join(others)}" if others else
                   f"pruning.{next(iter(budgets))}={next(iter(budgets.values()))!r} is set")
            raise ValueError(f"pruning.heads={self.heads!r} while {why}: random then draws every gated structure at "
                             "cost budgets; allowed: pruning.heads=null and one of pruning.params, pruning.flops, "
                             "pruning.latency=<fractions of the dense model's cost kept>")
        if others and not budgets:
            self.params = 0.5
        if self.unit is None and self.heads is None:
            self.heads = 0.5  # as it always was
        if self.unit is not None:
            budget_fractions(getattr(self, self.unit), self.unit)
        self.workload = Workload.of(self.workload)
        if self.workload.table is not None and self.unit != "latency":
            raise ValueError(f"pruning.workload.table={self.workload.table} is a latency fit, which only "
                             "pruning.latency uses; allowed: with latency, or table null")

    @property
    def unit(self) -> str | None:
        """The unit of the budgets (params, flops, latency), or None for heads drawn by count."""
        return next((unit for unit in UNITS if getattr(self, unit) is not None), None)

    def prepare(self, module, saved: dict | None) -> None:
        unit = self.unit
        if unit in ("flops", "latency"):  # the gates costed as pruning=l0_budget's are (the same cached fit)
            dirs = [*self.gating().cost_dirs, *([Path(self.cost_dir)] if self.cost_dir else [])]
            self.cost_source = gate_costs(unit, module.model, module.gates, self.workload, dirs)
        if unit is not None:  # a budget below what the model can reach is refused at set-up
            check_floor(module.gates, module.model, budget_fractions(getattr(self, unit), unit), unit)
        super().prepare(module, saved)

    def describe(self) -> dict:
        source = getattr(self, "cost_source", None)  # where a FLOPs or latency cost came from (gate_costs)
        return {**super().describe(), **({"costs": source} if source else {})}

    def levels(self, probe: HeadProbe) -> list[Level]:
        unit = self.unit
        if unit is not None:
            fractions = budget_fractions(getattr(self, unit), unit)
            return [Level(draw.heads_kept, draw.heads, draw.info, plan=draw.plan, budget=draw.fraction, unit=unit)
                    for draw in draw_within(probe.gates, probe.model, fractions, self.seed, unit)]
        order = torch.randperm(len(probe.heads), generator=torch.Generator().manual_seed(self.seed)).tolist()
        return [Level(count, sorted(probe.heads[i] for i in order[:count]), {"seed": self.seed})
                for count in head_counts(self.heads, len(probe.heads), "pruning.heads")]
