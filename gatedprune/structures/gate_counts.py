"""How many structures of each kind a set of gates has, keeps under a plan, or keeps in expectation.

A mixin of ``HeadGates`` (it reads the site layout: ``kinds``, ``layers``, ``paths``, ``structures``, ``gates``,
``group_sizes``): counts per kind, with "total" the attention heads, as every report prints them.
"""

from __future__ import annotations

from collections import Counter

import torch

from gatedprune.structures.kinds import ALL_KINDS, ATTENTION_KINDS


class GateCounts:
    """Counts per kind (heads, units, layers) of ``HeadGates``; "total" sums the attention kinds."""

    def _per_kind(self, per_site: list) -> dict:
        """Numbers given per site, summed per kind; "total" sums the attention kinds (heads)."""
        sums = Counter()
        for kind, value in zip(self.kinds, per_site):
            sums[kind] += value
        return {"total": sum(sums[k] for k in ATTENTION_KINDS), **{k: sums[k] for k in ALL_KINDS if k in sums}}

    def heads_per_kind(self) -> dict[str, int]:
        """Every gated structure per kind (heads, units, layers), and the heads in total."""
        return self._per_kind([gate.num_heads * size for gate, size in zip(self.gates, self.group_sizes)])

    def heads_alive(self) -> dict[str, int]:
        """What the binary rule keeps per kind (a head or unit of a dropped layer is not kept), heads in total."""
        return self.alive(self.plan(note=False))

    def alive(self, plan: dict) -> dict[str, int]:
        """Structures a plan keeps per kind, nesting-aware, and the heads in total."""
        dropped = self.dropped(plan)
        counts = []
        for i, path in enumerate(self.paths):
            if self.structures[i] == "layer":
                counts.append(int(self.layers[i] in plan.get(self.layers_paths[self.kinds[i]], [])))
            else:
                counts.append(0 if (self.stacks[i], self.layers[i]) in dropped else len(plan.get(path, [])))
        return self._per_kind(counts)

    @torch.no_grad()
    def expected_open_per_kind(self) -> dict[str, float]:
        """Nesting-aware sum of P(open) per kind, and the heads in total."""
        return self._per_kind([(self.p_open_nested(i).sum() * self.group_sizes[i]).item() for i in range(len(self.gates))])

    def differences(self, plan: dict, other: dict) -> int:
        """How many structures one plan keeps and the other does not, nesting-aware: a layer one of them drops counts
        once, not with every head and unit inside it."""
        dropped = self.dropped(plan) | self.dropped(other)
        count = 0
        for i, path in enumerate(self.paths):
            if self.structures[i] == "layer":
                layers = self.layers_paths[self.kinds[i]]
                count += (self.layers[i] in plan.get(layers, [])) != (self.layers[i] in other.get(layers, []))
            elif (self.stacks[i], self.layers[i]) not in dropped:
                count += len(set(plan.get(path, [])) ^ set(other.get(path, [])))
        return count
