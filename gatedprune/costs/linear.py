"""Costs linear in the structures a model keeps, and the expected cost of its gates under them.

A ``LinearCost`` of a model with n_k structures of kind k (heads of an attention kind, FFN units of a stack, layers of
a stack; ``counts.features``) is

    cost = base + sum_k c_k * n_k

FLOPs are exactly this (``flops``); latency is fitted to it (``latency``); parameters are counted per site instead
(a T5 position bias or a grouped key/value head is not a per-kind constant), by the same nesting rule.

``StructureCosts`` is what the gates are budgeted with (CoFiPruning's expected model size, in any unit). Per layer L
of a stack, with P(L) = 1 where the layer is not gated:

    E_L = P(L) * (fixed_L + sum over gated sites s in L of sum_g P(open_g) * cost_g)

cost_g is what gate g removes (a head's q/k/v/o parameters, its FLOPs, its fitted seconds; ``ffn_group`` units),
fixed_L the rest of L (norms, biases, ungated structures; a layer's own coefficient), which counts only when L is
gated, since only then can it go. prunable = sum over gated layers of everything in them + sum over the other layers
of their gated structures; what no gate can remove is total - prunable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gatedprune.costs.counts import empty_sites, features, layer_counts
from gatedprune.structures.kinds import KINDS, layer_kind


@dataclass(frozen=True)
class LinearCost:
    """``base + sum_k coefficients[k] * n_k`` in ``unit`` (seconds, FLOPs) for one workload."""

    unit: str
    base: float
    coefficients: dict[str, float]
    phantom: dict[str, float] = field(default_factory=dict)  # per attention module emptied of heads, per kind

    def of(self, model: nn.Module) -> float:
        """The cost of ``model`` as it is (a gated model counts every structure; a pruned one what it kept)."""
        return self.of_counts(features(model), empty_sites(model) if self.phantom else None)

    def of_counts(self, counts: dict[str, int], empty: dict[str, int] | None = None) -> float:
        """The cost of a model that keeps ``counts`` structures of each kind (``counts.features``), ``empty`` its
        attention modules emptied of heads per kind (``counts.empty_sites``; None: none counted)."""
        return (self.base + sum(self.coefficients.get(kind, 0.0) * count for kind, count in counts.items())
                + sum(self.phantom.get(kind, 0.0) * count for kind, count in (empty or {}).items()))


class StructureCosts:
    """The expected kept cost of a model's gates in one unit (see the module); ``within`` the plan that fits."""

    def __init__(self, unit: list[float], fixed: dict[int, float], prunable: float, total: float,
                 linear: LinearCost | None = None, phantom: list[float] | None = None):
        self.unit = unit  # per site: what one of its gates removes
        self.phantom = phantom or [0.0] * len(unit)  # per site: what it costs once emptied (LinearCost.phantom)
        self.fixed = fixed  # per layer gate: fixed_L
        self.prunable = prunable
        self.total = total
        self.linear = linear  # the per-kind cost it was made from, which also prices a pruned model (None: params)
        self.least = 0.0  # of the prunable cost, what every plan keeps (``keep_least``)

    @classmethod
    def of_parameters(cls, sites: list, gates, total: int) -> "StructureCosts":
        """Parameters: what each site's gate owns (``unit_parameters``), counted on the sites themselves."""
        unit = [float(s.unit_parameters() * size) for s, size in zip(sites, gates.group_sizes)]
        fixed, prunable = {}, 0
        for i, site in enumerate(sites):
            if gates.structures[i] == "layer":
                inner = sum(unit[j] * gates.gates[j].num_heads for j in range(len(sites)) if gates.outer[j] == i)
                fixed[i] = site.unit_parameters() - inner
                prunable += site.unit_parameters()
            elif gates.outer[i] is None:
                prunable += int(round(unit[i] * gates.gates[i].num_heads))
        return cls(unit, fixed, prunable, total).keep_least(gates)

    @classmethod
    def of_linear(cls, cost: LinearCost, model: nn.Module, gates) -> "StructureCosts":
        """A ``LinearCost``: a gate of kind k removes c_k per structure; a gated layer's fixed part is its own
        coefficient and its ungated structures'."""
        c = cost.coefficients
        per_layer = layer_counts(model)
        unit = [c.get(kind, 0.0) * size for kind, size in zip(gates.kinds, gates.group_sizes)]
        fixed, prunable = {}, 0.0
        for i, structure in enumerate(gates.structures):
            if structure == "layer":
                stack, layer = gates.stacks[i], gates.layers[i]
                gated_inside = {gates.kinds[j] for j in range(len(unit)) if gates.outer[j] == i}
                content = per_layer.get((stack, layer), {})
                fixed[i] = c.get(layer_kind(stack), 0.0) + sum(
                    c.get(kind, 0.0) * n for kind, n in content.items()
                    if KINDS[kind].structure != "layer" and kind not in gated_inside)
                prunable += fixed[i] + sum(unit[j] * gates.gates[j].num_heads for j in range(len(unit))
                                           if gates.outer[j] == i)
            elif gates.outer[i] is None:
                prunable += unit[i] * gates.gates[i].num_heads
        phantom = [cost.phantom.get(kind, 0.0) for kind in gates.kinds]
        return cls(unit, fixed, prunable, cost.of(model), cost, phantom).keep_least(gates)

    def _phantoms_in(self, gates, outer: int | None) -> float:
        """What the attention modules inside layer gate ``outer`` (None: outside gated layers) cost once emptied."""
        return sum(self.phantom[j] for j in range(len(self.unit)) if gates.outer[j] == outer)

    def _emptied_layers(self, gates, stack: str) -> list[float]:
        """What each gated layer of ``stack`` costs kept and emptied (its fixed part and its modules' phantom heads)."""
        return [self.fixed[i] + self._phantoms_in(gates, i) for i, st in enumerate(gates.structures)
                if st == "layer" and gates.stacks[i] == stack]

    def keep_least(self, gates) -> "StructureCosts":
        """Note what every plan keeps of the prunable cost: a decoder layer, where they are gated (the costliest, to be
        safe: ``within`` keeps the most open one), and the phantom head of every attention module a plan can empty."""
        self.least = self._phantoms_in(gates, None) + max(self._emptied_layers(gates, "decoder"), default=0.0)
        return self

    @property
    def floor(self) -> float:
        """The least fraction of ``total`` a plan can keep: what no gate can remove, and what every plan keeps."""
        return (self.total - self.prunable + self.least) / self.total

    def floor_with(self, gates, layers: dict[str, int]) -> float:
        """The least fraction of ``total`` a plan can keep that keeps ``layers`` ({stack: n}) gated layers of those
        stacks, emptied: ``floor`` with each named stack's n cheapest layers in place of what it keeps there (a lower
        bound, whichever layers are kept: the encoder none, the decoder the one ``keep_least`` counts)."""
        least = self.least
        for stack, n in layers.items():
            emptied = sorted(self._emptied_layers(gates, stack))
            least += sum(emptied[:n]) - (max(emptied, default=0.0) if stack == "decoder" else 0.0)
        return (self.total - self.prunable + least) / self.total

    def allowed(self, fraction: float) -> float:
        """Prunable cost a plan may keep to stay within ``fraction`` of the total."""
        return fraction * self.total - (self.total - self.prunable)

    @torch.no_grad()
    def within(self, gates, allowed: float) -> torch.Tensor:
        """The flat keep mask (N,) of the most open structures whose kept prunable cost does not exceed
        ``allowed``: gates are taken by log_alpha, largest first, a head or unit ranked no higher than its layer (it
        is kept only with it); a layer costs its fixed part, its content is paid for gate by gate. One that does not
        fit is passed over for smaller ones after it. A gate settled closed (``HeadGates.settle_``) is a decision,
        not a rank: it is never taken, however little it costs. What emptied attention modules still cost (their
        phantom head) is paid after: while it does not fit, the fill is redone with that much less allowed."""
        scores = gates.per_site(gates.log_alpha())
        order = []  # (score, site, gate)
        for i, score in enumerate(scores):
            outer = gates.outer[i]
            for j, value in enumerate(score.tolist()):
                order.append((min(value, scores[outer].item()) if outer is not None else value, i, j))
        order.sort(key=lambda e: (-e[0], gates.structures[e[1]] != "layer"))  # a layer before its content; stable
        # a decoder keeps a layer (HeadGates.plan would open its most open one): paid for first, so the plan fits
        decoder = [i for i, st in enumerate(gates.structures) if st == "layer" and gates.stacks[i] == "decoder"]
        forced = max(decoder, key=lambda i: scores[i].item()) if decoder else None
        budget = allowed
        while True:
            keep, spent = self._fill(gates, order, scores, budget, forced)
            over = spent + self._phantoms(gates, keep) - allowed
            if over <= 0 or budget < 0:  # fits, or nothing more can go (a target below the floor)
                return torch.cat(keep)
            budget -= over

    def _fill(self, gates, order: list, scores: list, allowed: float, forced: int | None
              ) -> tuple[list[torch.Tensor], float]:
        keep = [torch.zeros(len(s), dtype=torch.bool) for s in scores]
        spent = 0.0
        if forced is not None:
            keep[forced][0] = True
            spent += self.fixed[forced]
        for _, i, j in order:
            held = gates.settled.get(gates.paths[i])
            if i == forced or (held is not None and held[j] < 0):
                continue  # the forced layer is paid for; a gate settled closed stays closed
            outer = gates.outer[i]
            if outer is not None and not keep[outer][0]:
                continue  # its layer did not fit
            cost = self.fixed[i] if gates.structures[i] == "layer" else self.unit[i]
            if spent + cost <= allowed:
                keep[i][j] = True
                spent += cost
        return keep, spent

    def _phantoms(self, gates, keep: list[torch.Tensor]) -> float:
        """What the attention modules a mask empties still cost, in layers it keeps."""
        return sum(self.phantom[i] for i, kept in enumerate(keep) if self.phantom[i] and not kept.any()
                   and (gates.outer[i] is None or keep[gates.outer[i]][0]))

    @torch.no_grad()
    def kept(self, gates, keep: torch.Tensor) -> float:
        """Prunable cost a flat keep mask (N,) keeps: ``expected`` with every P(open) 0 or 1, plus what the attention
        modules it empties still cost."""
        per_site = [k.bool() for k in gates.per_site(keep)]
        return self._nested(gates, [k.double() for k in per_site]).item() + self._phantoms(gates, per_site)

    def expected(self, gates) -> torch.Tensor:
        """Expected kept prunable cost (differentiable in the gates' log_alpha)."""
        return self._nested(gates, [gate.p_open() for gate in gates.gates])

    def _nested(self, gates, open_: list[torch.Tensor]) -> torch.Tensor:
        """Kept prunable cost with site i's gates open by ``open_[i]`` (H_i,), P(open) or 0/1: a layer pays its fixed
        part and its content, each structure inside it counted times the layer's own value."""
        device, dtype = open_[0].device, open_[0].dtype
        inner = {i: torch.tensor(fixed, device=device, dtype=dtype) for i, fixed in self.fixed.items()}
        total = [torch.zeros((), device=device, dtype=dtype)]
        for i, value in enumerate(open_):
            if gates.structures[i] == "layer":
                continue
            own = (value * self.unit[i]).sum()
            if gates.outer[i] is None:
                total.append(own)
            else:
                inner[gates.outer[i]] = inner[gates.outer[i]] + own
        total += [open_[i].sum() * value for i, value in inner.items()]
        return torch.stack(total).sum()


def shown_fraction(fraction: float) -> float:
    """A fraction as an error message shows it, rounded up to 4 decimals: the value shown is allowed."""
    return math.ceil(fraction * 10_000) / 10_000
