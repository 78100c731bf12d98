"""What a method that scores a trained model produces: levels, each the heads (or the whole plan) it keeps.

The data the methods (``baselines``, ``random_draw``, ``even_layers``) hand to their run (``plan_run``), and what
a method may ask of the trained model (``HeadProbe``); neither side imports the other for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gatedprune.methods.budget import head_count

Head = tuple[str, int]  # (attention module path, head index)
Plan = dict[str, list[int]]


class HeadProbe(Protocol):
    """What a method may ask of the trained model (``gatedprune.methods.plan_run.MaskedModel`` answers)."""

    heads: list[Head]  # every gated head, in site order
    gates: object  # the HeadGates of every gated kind, and the model they gate: a random draw at a parameter
    model: object  # budget names whole plans and measures them (gatedprune.methods.random_draw)

    def plan(self, kept) -> Plan: ...
    def loss(self, kept) -> float: ...  # validation-subset loss with only ``kept`` heads
    def bleu(self, kept) -> float: ...  # validation-subset BLEU with only ``kept`` heads
    def importance(self, kept, layer_norm_exponent: float | None) -> dict[str, torch.Tensor]: ...


@dataclass
class Level:
    """One point a method stops at: the heads it keeps, and what it measured on the way there."""

    heads: int
    kept: list[Head]
    info: dict = field(default_factory=dict)
    plan: Plan | None = None  # the whole plan (heads, units, layers) of a level drawn at a cost budget
    budget: float | None = None  # that budget: at most this fraction of the dense model's cost in ``unit`` kept
    unit: str = "params"  # params (non-embedding), flops or latency (predicted, for pruning.workload)
    tag: str | None = None  # the name of a level given by its plan alone (pruning=even_layers: decoder_2_of_6)

    @property
    def name(self) -> str:
        """Its directory under ``<run>/levels/``."""
        if self.tag:
            return self.tag
        return f"{self.heads:03d}_heads" if self.budget is None else f"{self.unit}_{self.budget:g}"

    def __str__(self) -> str:
        if self.tag:
            return self.tag.replace("_", " ")
        return f"{self.heads} heads" if self.budget is None else f"{self.unit} {self.budget:g}"


def gate_starts(gates) -> list[int]:
    """Where each site's gates begin in the flat order of ``gates.log_alpha()``."""
    return [0, *itertools.accumulate(gate.num_heads for gate in gates.gates)][:-1]


def plan_heads(gates, plan: Plan) -> list[Head]:
    """The heads a whole plan keeps, outside the layers it drops, sorted."""
    dropped = gates.dropped(plan)
    return sorted((path, head) for i, path in enumerate(gates.paths) if gates.structures[i] == "heads"
                  and (gates.stacks[i], gates.layers[i]) not in dropped for head in plan[path])


def head_counts(spec, total: int, name: str) -> list[int]:
    """Head counts, largest first: each entry a count or a fraction in (0, 1) of the ``total`` gated heads."""
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not values:
        raise ValueError(f"{name}=[]; allowed: one or more head counts from 0 to {total} or fractions in (0, 1)")
    counts = [head_count(value, total, f"{name}={value!r}") for value in values]
    for i, count in enumerate(counts):  # a level asked for twice is a typo more often than not: never merged quietly
        if count in counts[:i]:
            first = values[counts.index(count)]
            both = "" if first == values[i] else f" ({first!r} and {values[i]!r} of the {total} gated heads)"
            raise ValueError(f"{name}={values} names {count} heads twice{both}; allowed: distinct head counts")
    return sorted(counts, reverse=True)
