"""Attach hard-concrete head gates to a Hugging Face seq2seq model.

Each gated attention module gets a forward pre-hook on its output projection. The projection's input is
the concatenation of the heads' outputs, head-major: head h is the slice [h*D, (h+1)*D) of the last
dimension, so multiplying that slice by g_h gates head h before W_O (Voita et al. 2019). This works for
every family and attention implementation (eager, sdpa), unlike ``head_mask``, which transformers v5 ignores.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from gatedprune.adapters import ATTENTION_KINDS, AttentionSite, attention_sites, check_kinds
from gatedprune.gates import GATE_MODES, GateOptions, HardConcreteGate

PENALTY_NORMALISATIONS = ("layer_mean", "sum", "head_mean")


class HeadGates(nn.Module):
    """The gates of one model: a ``HardConcreteGate`` per attention module, hooked into its output projection.

    ``log_alpha`` of site i is ``self.gates[i].log_alpha``; ``self.paths[i]`` names its attention module.
    """

    def __init__(self, sites: list[AttentionSite], options: GateOptions):
        super().__init__()
        self.options = options
        self.paths = [s.path for s in sites]
        self.kinds = [s.kind for s in sites]
        self.layers = [s.layer for s in sites]
        self.gates = nn.ModuleList(HardConcreteGate(s.num_heads, options) for s in sites)
        self.mode = "sample"
        self._handles = [
            site.projection("o").register_forward_pre_hook(self._make_hook(gate, site.head_dim))
            for site, gate in zip(sites, self.gates)
        ]

    def _make_hook(self, gate: HardConcreteGate, head_dim: int):
        def hook(o_proj: nn.Module, args: tuple) -> tuple:
            (x, *rest) = args  # x: (B, T, H*D), head-major
            g = gate.value(self.mode, o_proj.training).to(x.dtype)  # (H,)
            x = (x.unflatten(-1, (-1, head_dim)) * g[:, None]).flatten(-2)
            return (x, *rest)

        return hook

    def set_mode(self, mode: str) -> "HeadGates":
        """"sample" (noise while training, deterministic in eval), "deterministic", "binary" or "open" (all 1)."""
        if mode not in GATE_MODES:
            raise ValueError(f"unknown gate mode {mode!r}; allowed: {', '.join(GATE_MODES)}")
        self.mode = mode
        return self

    def remove(self) -> None:
        """Detach every hook; the model computes as if it had never been gated."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expected_open(self) -> torch.Tensor:
        """Expected number of open heads, sum of P(open) over all gates (differentiable scalar)."""
        return torch.stack([g.p_open().sum() for g in self.gates]).sum()

    def penalty(self, normalisation: str = "layer_mean") -> torch.Tensor:
        """The L0 penalty that multiplies lambda.

        - ``layer_mean`` (Voita et al.'s code): per-layer sum of P(open), averaged over gated layers
        - ``sum`` (Voita et al.'s paper formula): sum of P(open) over all gated heads
        - ``head_mean``: mean of P(open) over all gated heads (the expected fraction of heads open)
        """
        per_layer = torch.stack([g.p_open().sum() for g in self.gates])  # (L,)
        if normalisation == "layer_mean":
            return per_layer.mean()
        if normalisation == "sum":
            return per_layer.sum()
        if normalisation == "head_mean":
            return per_layer.sum() / self.num_heads
        raise ValueError(
            f"unknown penalty normalisation {normalisation!r}; allowed: {', '.join(PENALTY_NORMALISATIONS)}"
        )

    @property
    def num_heads(self) -> int:
        return sum(g.num_heads for g in self.gates)

    def kept(self, site: int) -> list[int]:
        """Head indices of site ``site`` that the binary rule keeps."""
        return torch.nonzero(self.gates[site].log_alpha > 0).flatten().tolist()

    def plan(self) -> dict[str, list[int]]:
        """``{attention module path: sorted kept head indices}`` under the binary rule (log_alpha > 0)."""
        return {path: self.kept(i) for i, path in enumerate(self.paths)}

    def _per_kind(self, per_site: list) -> dict:
        """Numbers given per site (gated module), summed per attention kind and in total."""
        sums = Counter()
        for kind, value in zip(self.kinds, per_site):
            sums[kind] += value
        return {"total": sum(per_site), **{k: sums[k] for k in ATTENTION_KINDS if k in sums}}

    def heads_per_kind(self) -> dict[str, int]:
        """All gated heads, per kind and in total."""
        return self._per_kind([gate.num_heads for gate in self.gates])

    def heads_alive(self) -> dict[str, int]:
        """Binary-rule open heads per kind, and in total."""
        return self._per_kind([len(self.kept(i)) for i in range(len(self.gates))])

    @torch.no_grad()
    def expected_open_per_kind(self) -> dict[str, float]:
        """Sum of P(open) per kind, and in total."""
        return self._per_kind([gate.p_open().sum().item() for gate in self.gates])

    @torch.no_grad()
    def clamp_(self) -> None:
        for gate in self.gates:
            gate.clamp_()

    def extra_repr(self) -> str:
        counts = Counter(self.kinds)
        return ", ".join(f"{k}: {counts[k]} layers" for k in ATTENTION_KINDS if k in counts) + f", {self.num_heads} heads"

    # the site layout travels with the weights, so a checkpoint says which module each gate belongs to
    def get_extra_state(self) -> dict:
        return {"paths": self.paths, "kinds": self.kinds, "layers": self.layers}

    def set_extra_state(self, state: dict) -> None:
        if state["paths"] != self.paths:
            raise ValueError(
                f"checkpoint gates belong to modules {state['paths'][:3]}..., this model's to {self.paths[:3]}..."
            )


def attach_gates(model: nn.Module, kinds=ATTENTION_KINDS, **gate_options) -> HeadGates:
    """Gate every head of the given attention kinds of ``model``; returns the module holding the gates.

    ``gate_options`` are the fields of ``GateOptions`` (temperature, stretch, eps, init_log_alpha, log_alpha_range).
    """
    options = GateOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in gate_options.items()})
    sites = attention_sites(model, check_kinds(kinds))
    gates = HeadGates(sites, options)
    return gates.to(next(model.parameters()).device)
