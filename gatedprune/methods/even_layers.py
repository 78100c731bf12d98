"""``pruning=even_layers``: keep k evenly spaced decoder layers, the first and the last among them, and fine-tune.

What a user does instead of learning what goes: the layer-copying students of Distil-Whisper (Gandhi et al. 2023:
first and last decoder layer) and of deep-encoder / shallow-decoder translation (Kasai et al. 2021), followed by
fine-tuning, with sequence-level distillation (``finetune.targets=dense_greedy``, Kim and Rush 2016) or without.
Of L layers, k >= 2 keeps round(i (L - 1) / (k - 1)) for i = 0 .. k - 1; k = 1 keeps the first (the layer the
embeddings feed). Every other structure stays. One level per k, into ``<run>/levels/decoder_<k>_of_<L>/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gatedprune.methods.baselines import PlanMethod
from gatedprune.methods.levels import HeadProbe, Level, gate_starts, plan_heads


def even_layers(total: int, keep: int) -> list[int]:
    """Indices of ``keep`` evenly spaced layers of ``total``, the first and the last included when keep >= 2."""
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= total:
        raise ValueError(f"pruning.decoder_layers names {keep!r}; allowed: layer counts from 1 to the model's {total} "
                         "decoder layers")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


@dataclass
class EvenLayers(PlanMethod):
    """Keep ``decoder_layers`` evenly spaced decoder layers (a count or a list of them: one level each)."""

    name: ClassVar[str] = "even_layers"
    heads_only: ClassVar[bool] = False
    kinds: tuple[str, ...] = ("decoder_layer",)
    decoder_layers: list | int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if "decoder_layer" not in self.kinds:
            raise ValueError(f"pruning=even_layers drops decoder layers; allowed: pruning.kinds naming decoder_layer "
                             f"(got {', '.join(self.kinds)})")
        counts = self.counts
        if not counts or len(set(counts)) < len(counts):
            raise ValueError(f"pruning.decoder_layers={self.decoder_layers!r}; allowed: one or more distinct layer "
                             "counts")

    @property
    def counts(self) -> list:
        """The layer counts kept, one level each, most first."""
        values = list(self.decoder_layers) if isinstance(self.decoder_layers, (list, tuple)) else [self.decoder_layers]
        return sorted(values, key=lambda v: -v if isinstance(v, (int, float)) else 0)

    def check(self, total: int) -> None:
        pass  # counts layers, not heads: checked against the model in prepare

    def prepare(self, module, saved: dict | None) -> None:
        layers = module.gates.kinds.count("decoder_layer")
        for keep in self.counts:
            even_layers(layers, keep)  # refused at set-up, before anything is scored
        super().prepare(module, saved)

    def levels(self, probe: HeadProbe) -> list[Level]:
        gates = probe.gates
        decoder = [i for i, kind in enumerate(gates.kinds) if kind == "decoder_layer"]  # one gate per layer
        starts = gate_starts(gates)
        levels = []
        for keep in self.counts:
            kept_layers = even_layers(len(decoder), keep)
            mask = torch.ones(gates.num_gates, dtype=torch.bool)  # (N,): every structure, but the layers left out
            for i in decoder:
                mask[starts[i]] = gates.layers[i] in kept_layers
            plan = gates.plan(keep=mask, note=False)
            levels.append(Level(gates.alive(plan)["total"], plan_heads(gates, plan), {"decoder_layers": kept_layers},
                                plan=plan, tag=f"decoder_{keep}_of_{len(decoder)}"))
        return levels
