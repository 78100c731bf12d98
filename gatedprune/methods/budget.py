"""An exact head budget: a Lagrangian controller on the expected number of open heads.

In the style of Wang et al. 2020 and CoFiPruning (Xia et al. 2022): for each budget group (all gated heads, or
one attention kind) with s = expected fraction of its heads open and t = target fraction,

    penalty = lambda1 * (s - t) + lambda2 * (s - t) ** 2

where lambda1 and lambda2 start at 0 and are trained by gradient ascent (their gradients are negated), so the
pressure grows for as long as s misses t. The target ramps linearly from "all heads open" to its final value
over ``warmup_steps`` gated steps. At export, the top-k rule keeps exactly the target number of heads.

With ``pruning.uniform_heads`` / ``uniform_ffn`` (``gates.uniform``, ``gatedprune.structures.uniform``) the export
keeps one count per layer of a kind, so the budget asks for that shape too: beside each group's constraint above, one
constraint per layer i of each uniform kind K, with its own multipliers,

    gap_i = s_i - mean_{j in K} s_j,    s_i = mean over the gates of layer i of P(open)

(the layer's own gates, not nested: a layer gate decides whether the layer stays, not how many it keeps). The group's
target fixes the total, these ties spread it evenly: with a per-kind ``target_heads``, both hold only when every layer
of K expects target / L_K open heads, the target applied per layer; a "total" target splits over the kinds as
training settles it, each kind evenly over its layers. A cost budget (parameters, FLOPs, latency) is tied the same way. The export then keeps
round(kept / L) per layer, so a target that L does not divide is met to within L / 2 structures.
"""

from __future__ import annotations

import torch
from torch import nn

from gatedprune.costs.linear import shown_fraction
from gatedprune.structures.adapters import ATTENTION_KINDS
from gatedprune.structures.head_gates import PLAN_MODES, HeadGates

TargetSpec = int | float | dict


def layer_ties(gates: HeadGates) -> list[list[int]]:
    """The sites of each kind in ``gates.uniform`` that have two or more layers to tie."""
    ties = [[i for i, kind in enumerate(gates.kinds) if kind == uniform] for uniform in gates.uniform]
    return [sites for sites in ties if len(sites) > 1]


def tie_gaps(gates: HeadGates, ties: list[list[int]]) -> torch.Tensor:
    """Per tied layer: its own open fraction less its kind's mean, s_i - mean_j s_j (see the module).  # (C,)"""
    gaps = []
    for sites in ties:
        s = torch.stack([gates.gates[i].p_open().mean() for i in sites])  # (L,)
        gaps.append(s - s.mean())
    return torch.cat(gaps) if gaps else gates.gates[0].log_alpha.new_zeros(0)


class _Lagrangian(nn.Module):
    """lambda1 * gap + lambda2 * gap**2 summed over constraints: the groups', then the layer ties' (``layer_ties``)."""

    def _multipliers(self, gates: HeadGates, groups: int) -> None:
        self.ties = layer_ties(gates)
        constraints = groups + sum(len(sites) for sites in self.ties)
        self.lambda1 = nn.Parameter(torch.zeros(constraints))
        self.lambda2 = nn.Parameter(torch.zeros(constraints))
        for multiplier in (self.lambda1, self.lambda2):
            multiplier.register_hook(torch.neg)  # gradient ascent under any minimising optimiser

    def _lagrangian(self, group_gap: torch.Tensor) -> torch.Tensor:
        gap = torch.cat([group_gap, tie_gaps(self.gates[0], self.ties)])  # (G + C,)
        return (self.lambda1 * gap + self.lambda2 * gap**2).sum()


def check_cost_options(method) -> None:
    """Refuse, in one line, an ``L0Budget`` option the run cannot use: a true/false option given something else, an
    option of cost budgets under a head budget, and the eval-mode mask shipped (``export_fill=false``) with no mask."""
    for name in ("target_ceiling", "export_fill"):
        if not isinstance(getattr(method, name), bool):
            raise ValueError(f"pruning.{name}={getattr(method, name)!r}; allowed: true or false")
    cost_only = {"target_ceiling": (method.target_ceiling, "it bounds a cost", "false"),
                 "export_fill": (not method.export_fill, "it decides a cost budget's export", "true"),
                 "settle_widths_at": (method.settle_widths_at is not None, "it settles at a cost's plan", "null")}
    for name, (used, why, default) in cost_only.items():
        if used and method.cost_unit is None:
            raise ValueError(f"pruning.{name}={str(getattr(method, name)).lower()} with a head budget (no cost "
                             f"target): {why}; allowed: with target_params, target_flops or target_latency, or "
                             f"{name}={default}")
    if not method.export_fill and method.eval_gate_mode not in PLAN_MODES:
        raise ValueError(f"pruning.export_fill=false ships the eval-mode mask, and pruning.eval_gate_mode="
                         f"{method.eval_gate_mode} is not a mask; allowed: eval_gate_mode in {', '.join(PLAN_MODES)}, "
                         "or export_fill=true")


def head_count(value, total: int, name: str) -> int:
    """A number of heads out of ``total``: a count (an integer) or a fraction in (0, 1) of them, rounded;
    ``ValueError`` starting with ``name`` for anything else."""
    fraction = isinstance(value, float) and 0 < value < 1
    if isinstance(value, bool) or not (isinstance(value, int) or fraction) or not 0 <= value <= total:
        raise ValueError(f"{name}: allowed a count from 0 to the {total} gated heads there, or a fraction in (0, 1)")
    return round(value * total) if fraction else value


def resolve_targets(target_heads: TargetSpec, gates: HeadGates) -> dict[str, int]:
    """``{group: heads to keep}``: a count, a fraction of the gated heads, or a dict of either per attention kind.

    Groups are "total", or attention kinds when ``target_heads`` is a dict.
    """
    heads = gates.heads_per_kind()
    spec = dict(target_heads) if isinstance(target_heads, dict) else {"total": target_heads}
    targets = {}
    for group, value in spec.items():
        if group not in heads:
            allowed = ", ".join(k for k in ATTENTION_KINDS if k in heads)
            raise ValueError(f"pruning.target_heads names {group!r}, which is not gated; allowed: {allowed}")
        count = head_count(value, heads[group], f"pruning.target_heads={value!r} for {group}")
        targets[group] = count
    return targets


class HeadBudget(_Lagrangian):
    """Drives the expected number of open heads of each group to its target (and ties the layers of a uniform kind)."""

    def __init__(self, gates: HeadGates, targets: dict[str, int], warmup_steps: int):
        super().__init__()
        self.gates = [gates]  # a list, so the gates are not registered (and saved) twice
        self.targets = targets
        self.groups = list(targets)
        per_kind = gates.heads_per_kind()
        self.heads = [per_kind[g] for g in self.groups]
        self.warmup_steps = warmup_steps
        self._multipliers(gates, len(self.groups))

    def target_fraction(self, gated_step: int) -> torch.Tensor:
        """t per group after ``gated_step`` gated steps: 1 (all open) ramping linearly to the final fraction.  # (G,)"""
        final = torch.tensor([self.targets[g] / n for g, n in zip(self.groups, self.heads)])
        ramp = min(1.0, gated_step / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        return 1.0 - ramp * (1.0 - final)

    def expected_fraction(self) -> torch.Tensor:
        """s per group: the expected fraction of its heads open (differentiable).  # (G,)"""
        gates = self.gates[0]
        return torch.stack([gates.expected_open(g) / n for g, n in zip(self.groups, self.heads)])

    @torch.no_grad()
    def report(self) -> dict[str, dict[str, float]]:
        """Per group: the target head count and the expected number of open heads now (how far training got)."""
        expected = self.expected_fraction().cpu() * torch.tensor(self.heads, dtype=torch.float32)
        return {g: {"target": self.targets[g], "expected_open": e.item()} for g, e in zip(self.groups, expected)}

    def forward(self, gated_step: int) -> torch.Tensor:
        gap = self.expected_fraction() - self.target_fraction(gated_step).to(self.lambda1.device)  # (G,)
        return self._lagrangian(gap)


class CostBudget(_Lagrangian):
    """Drives the expected kept fraction of the dense model's cost in one unit to ``target`` (one group).

    unit: ``params`` (non-embedding parameters), ``flops`` or ``latency`` of ``pruning.workload``
    (``gatedprune.costs``); s = (cost the gates cannot remove + expected kept prunable cost) / dense cost,
    nesting-aware (``StructureCosts.expected``); the same Lagrangian as ``HeadBudget``, its target ramping from 1.
    A target below what removing every prunable structure reaches is refused with that floor, unless the run gates
    nothing (``gates_nothing``: a dense run, the default's dense phase alone, which only measures and caches the fit).
    """

    WHAT = {"params": "non-embedding parameters", "flops": "FLOPs", "latency": "predicted latency"}

    def __init__(self, gates: HeadGates, unit: str, target: float, warmup_steps: int, gates_nothing: bool = False,
                 ships: str | None = None, ceiling: bool = False):
        super().__init__()
        # ceiling: lambda1 >= 0 after every step. Under Adam lambda1 moves by about its learning rate each step
        # whatever the gap, so while the cost sits just under the target it sinks below zero and later pushes the
        # gates open all at once (docs/gates.md 0k); lambda2's term still draws a cost under the target towards it
        self.ceiling = ceiling
        # None: the export fills the target with the most open structures; a plan mode (the gated model's own mask in
        # eval mode): the export ships that mask wherever it fits the target (``export_rule``)
        self.ships = ships
        self.gates = [gates]
        self.unit = unit
        self.costs = gates.costs[unit]
        floor = self.costs.floor
        if target < floor and not gates_nothing:
            least = shown_fraction(floor)
            raise ValueError(f"pruning.target_{unit}={target} is below what removing every gated structure reaches "
                             f"({least} of the dense model's {self.WHAT[unit]}); allowed: a fraction in [{least}, 1)")
        self.target = target
        self.warmup_steps = warmup_steps
        self.groups = [unit]
        self._multipliers(gates, 1)

    @property
    def targets(self) -> dict[str, float]:
        return {self.unit: self.target}

    @property
    def kept_allowed(self) -> float:
        """Prunable cost the export may keep: the target less what no gate can remove (parameters: a count)."""
        if self.unit == "params":
            return int(self.target * self.costs.total) - (self.costs.total - self.costs.prunable)
        return self.costs.allowed(self.target)

    def export_rule(self) -> tuple[str, float | int | None]:
        """(rule, top_k) of the export: the most open structures whose cost fits the target; or, with ``ships``, the
        gated model's own eval-mode mask, exactly the model validated (CoFiPruning's export), wherever it fits the
        target, and the fill where it does not. The fill reinstates structures whose gates the model learned to do
        without: it can score below the smaller mask it fills (docs/gates.md)."""
        if self.ships is not None:  # "fits" as the fill counts it: the prunable cost kept within kept_allowed
            mask = torch.cat(self.gates[0].plan_mask(self.ships, note=False))
            if self.costs.kept(self.gates[0], mask) <= self.kept_allowed + 1e-9 * abs(self.kept_allowed):
                return self.ships, None
        return self.unit, self.kept_allowed

    @property
    def rule_key(self) -> list:
        """What decides the export's rule, not the gates' values: a resumed run compares it with its checkpoint's."""
        return [self.unit, self.kept_allowed, *([self.ships] if self.ships else [])]

    def target_fraction(self, gated_step: int) -> torch.Tensor:
        ramp = min(1.0, gated_step / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        return torch.tensor([1.0 - ramp * (1.0 - self.target)])  # (1,)

    def expected_fraction(self) -> torch.Tensor:
        fixed = self.costs.total - self.costs.prunable
        return ((fixed + self.costs.expected(self.gates[0])) / self.costs.total).reshape(1)  # (1,)

    def kept_fraction(self, keep: torch.Tensor) -> float:
        """The fraction of the dense model's cost a flat keep mask (N,) keeps."""
        fixed = self.costs.total - self.costs.prunable
        return (fixed + self.costs.kept(self.gates[0], keep)) / self.costs.total

    @torch.no_grad()
    def report(self) -> dict[str, dict[str, float]]:
        """The target beside four costs of where the gates are: expected (what the Lagrangian drives), the two
        deterministic masks the gated model is evaluated with (``pruning.eval_gate_mode``: log_alpha > 0, and
        CoFiPruning's expected size per kind), each as its plan keeps it (the decoder's floor included), and the
        export's plan (``export_rule``)."""
        gates = self.gates[0]
        shipped, top_k = self.export_rule()
        return {self.unit: {"target": self.target, "expected_kept": self.expected_fraction().item(),
                            **{f"{mode}_kept": self.kept_fraction(torch.cat(gates.plan_mask(mode, note=False)))
                               for mode in PLAN_MODES},
                            "plan_kept": self.kept_fraction(torch.cat(gates.plan_mask(shipped, top_k, note=False))),
                            "plan_rule": shipped}}

    def forward(self, gated_step: int) -> torch.Tensor:
        gap = self.expected_fraction() - self.target_fraction(gated_step).to(self.lambda1.device)  # (1,)
        return self._lagrangian(gap)

    @torch.no_grad()
    def project_(self) -> None:
        """After each optimiser step: with ``ceiling``, the cost's lambda1 back to >= 0 (the layer ties' stay free:
        they are equalities)."""
        if self.ceiling:
            self.lambda1[: len(self.groups)].clamp_(min=0)
