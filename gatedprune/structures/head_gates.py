"""Attach hard-concrete head gates to a Hugging Face seq2seq model.

Each gated attention module gets a forward pre-hook on its output projection. The projection's input is
the concatenation of the heads' outputs, head-major: head h is the slice [h*D, (h+1)*D) of the last
dimension, so multiplying that slice by g_h gates head h before W_O (Voita et al. 2019). This works for
every family and attention implementation (eager, sdpa), unlike ``head_mask``, which transformers v5 ignores.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import nn

from gatedprune.structures.adapters import ATTENTION_KINDS, AttentionSite, attention_sites, check_kinds
from gatedprune.structures.hard_concrete import GATE_MODES, GateOptions, HardConcreteGate

PENALTY_NORMALISATIONS = ("layer_mean", "sum", "head_mean")
RULES = ("binary", "top-k")  # how gates become a plan: log_alpha > 0, or the k largest log_alpha


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

    def set_temperature(self, temperature: float) -> None:
        """Every gate's hard-concrete temperature (annealing): the other constants stay."""
        self.options = dataclasses.replace(self.options, temperature=temperature)
        for gate in self.gates:
            gate.options = self.options

    def remove(self) -> None:
        """Detach every hook; the model computes as if it had never been gated."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expected_open(self, group: str = "total") -> torch.Tensor:
        """Expected number of open heads of a group ("total" or a kind): sum of P(open) (differentiable scalar)."""
        return torch.stack([self.gates[i].p_open().sum() for i in self.group(group)]).sum()

    # ---- one flat view of every gated head: (path, kind, layer, head) -----------------------------------------
    def group(self, group: str) -> list[int]:
        """The sites of a budget group: "total" (all) or one attention kind; ``ValueError`` for a kind not gated."""
        if group != "total" and group not in self.kinds:
            allowed = ", ".join(k for k in ATTENTION_KINDS if k in self.kinds)
            raise ValueError(f"{group!r} is not a gated attention kind; allowed: total, {allowed}")
        return [i for i, kind in enumerate(self.kinds) if group in ("total", kind)]

    def index(self) -> list[tuple[str, str, int, int]]:
        """(path, kind, layer, head) of every gated head, in the order of ``log_alpha()``."""
        return [(path, kind, layer, head) for path, kind, layer, gate in zip(self.paths, self.kinds, self.layers, self.gates)
                for head in range(gate.num_heads)]

    @torch.no_grad()
    def log_alpha(self) -> torch.Tensor:
        """Every gate's ``log_alpha``, flat, on CPU.  # (N,)"""
        return torch.cat([gate.log_alpha.detach().cpu() for gate in self.gates])

    def per_site(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat per-head tensor (N,) cut back into one (H,) tensor per site."""
        return list(flat.split([gate.num_heads for gate in self.gates]))

    def by_kind(self, values: list[torch.Tensor]) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """Per-site values regrouped: ``{kind: [(layer, values of that site), ...]}`` (a layer x head picture)."""
        out: dict[str, list] = {}
        for kind, layer, value in zip(self.kinds, self.layers, values):
            out.setdefault(kind, []).append((layer, value))
        return out

    @torch.no_grad()
    def unconverged(self) -> int:
        """How many deterministic gates lie strictly between 0 and 1 (neither clearly open nor clearly closed)."""
        values = torch.cat([gate.deterministic() for gate in self.gates])  # (N,)
        return int(((values > 0) & (values < 1)).sum())

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
        return torch.nonzero(self.gates[site].binary()).flatten().tolist()

    def plan(self, rule: str = "binary", top_k: int | dict[str, int] | None = None) -> dict[str, list[int]]:
        """``{attention module path: sorted kept head indices}`` under a rule.

        - ``binary`` (Voita et al.): the heads with ``log_alpha > 0``;
        - ``top-k``: the ``top_k`` heads with the largest ``log_alpha`` overall, or per budget group with
          ``top_k={kind: k}`` (kinds it does not name follow the binary rule). Ties: the earlier head wins.
        """
        if rule not in RULES:
            raise ValueError(f"unknown gate rule {rule!r}; allowed: {', '.join(RULES)}")
        if rule == "binary":
            if top_k is not None:
                raise ValueError("top_k is only used by rule='top-k'")
            return {path: self.kept(i) for i, path in enumerate(self.paths)}
        scores = self.log_alpha()  # (N,)
        keep = torch.cat([gate.binary().detach().cpu().bool() for gate in self.gates])  # (N,)
        site_of_head = torch.repeat_interleave(torch.tensor([g.num_heads for g in self.gates]))  # (N,)
        for group, k in (dict(top_k) if isinstance(top_k, dict) else {"total": top_k}).items():
            members = torch.nonzero(torch.isin(site_of_head, torch.tensor(self.group(group)))).flatten()
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= len(members):
                raise ValueError(f"rule 'top-k' needs 0 <= top_k <= {len(members)} (the gated heads of {group}), got {k!r}")
            ranked = members[torch.argsort(scores[members], descending=True, stable=True)]
            keep[ranked] = False
            keep[ranked[:k]] = True
        return {path: torch.nonzero(k).flatten().tolist() for path, k in zip(self.paths, self.per_site(keep))}

    @torch.no_grad()
    def fix_(self, plan: dict[str, list[int]]) -> "HeadGates":
        """Set the gates so that the binary rule keeps exactly ``plan`` (sites it does not name: unchanged), at
        log_alpha -10 or 10: settled, so each deterministic gate is 0 or 1 too (with the default stretch)."""
        for path, gate in zip(self.paths, self.gates):
            if path in plan:
                gate.log_alpha.fill_(-10.0)
                gate.log_alpha[plan[path]] = 10.0
        return self

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
