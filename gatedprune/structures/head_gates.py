"""Attach hard-concrete gates to a Hugging Face seq2seq model: on heads, feed-forward units and whole layers.

Each site (``gatedprune.structures.sites``) hooks its own gate in: a head's on the attention output before the
output projection (Voita et al. 2019), a unit's on the feed-forward block's inner activation, a layer's on the
layer's output (``x + z * (layer(x) - x)``). This works for every family and attention implementation, unlike
``head_mask``, which transformers v5 ignores. The nesting lives in the cost, not in the hooks: a head or unit inside
a gated layer is kept only if its layer is, so its expected contribution is the product of the P(open) along the
path (CoFiPruning's expected model size), and a plan drops what lies inside a dropped layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch
from torch import nn

from gatedprune.costs.linear import StructureCosts
from gatedprune.structures.adapters import probe
from gatedprune.structures.gate_counts import GateCounts
from gatedprune.structures.hard_concrete import GATE_MODES, GateOptions, HardConcreteGate, decided
from gatedprune.structures.kinds import ALL_KINDS, ATTENTION_KINDS, KINDS, check_kinds
from gatedprune.structures.sites import structure_sites
from gatedprune.structures.uniform import even_out, uniform_kinds

PENALTY_NORMALISATIONS = ("layer_mean", "sum", "head_mean", "params")
# how gates become a plan: log_alpha > 0; the k largest log_alpha; per kind, the round(sum of P(open)) largest
# (CoFiPruning's deterministic mask, which keeps the expected size)
RULES = ("binary", "top-k", "expected_size")
# and, for a budget in a cost unit: the most open structures whose cost fits (top_k: the prunable cost kept)
COST_UNITS = ("params", "flops", "latency")
PLAN_RULES = (*RULES, *COST_UNITS)
# modes in which every gate is its plan's keep mask (0 or 1), the decoder's floor and uniform shapes included, so
# the gated model in eval mode computes what that rule's export computes
PLAN_MODES = ("binary", "expected_size")
MODES = (*GATE_MODES, *(m for m in PLAN_MODES if m not in GATE_MODES))


class HeadGates(GateCounts, nn.Module):
    """The gates of one model: a ``HardConcreteGate`` per site (attention module, feed-forward block or layer).

    ``log_alpha`` of site i is ``self.gates[i].log_alpha``; ``self.paths[i]`` names its module. A feed-forward gate
    covers ``ffn_group`` contiguous units. "total" counts attention heads, as it always has.
    """

    def __init__(self, sites: list, options: GateOptions, ffn_group: int = 1):
        super().__init__()
        self.options = options
        self.paths = [s.path for s in sites]
        self.kinds = [s.kind for s in sites]
        self.layers = [s.layer for s in sites]
        self.structures = [KINDS[k].structure for k in self.kinds]
        self.stacks = [KINDS[k].stack for k in self.kinds]
        self.group_sizes = [ffn_group if st == "units" else 1 for st in self.structures]
        for site, size in zip(sites, self.group_sizes):
            if site.num_units % size:
                raise ValueError(f"pruning.ffn_group={size}: {site.path} has {site.num_units} units, not a multiple "
                                 f"of {size}; allowed: a divisor of every gated feed-forward width")
        self.layers_paths = {s.kind: s.layers_path for s in sites if KINDS[s.kind].structure == "layer"}
        self.gates = nn.ModuleList(HardConcreteGate(s.num_units // g, options) for s, g in zip(sites, self.group_sizes))
        self.mode = "sample"
        self._mask: tuple[tuple, list[torch.Tensor]] | None = None  # (log_alpha versions, mode): the plan mode's mask
        self.settled: dict[str, list[float]] = {}  # path -> the log_alpha its gates are held at (``settle_``)
        self.uniform: tuple[str, ...] = ()  # kinds whose layers all keep one count (``set_uniform``)
        # the layer gate whose layer holds site i (None: its layer is not gated, or it is a layer)
        layer_gate = {(self.stacks[i], self.layers[i]): i for i, st in enumerate(self.structures) if st == "layer"}
        self.outer = [None if st == "layer" else layer_gate.get((self.stacks[i], self.layers[i]))
                      for i, st in enumerate(self.structures)]
        # the expected kept cost per unit (gatedprune.costs.linear): parameters always, FLOPs and latency once a budget
        # in them has measured the model (set_costs)
        self.costs: dict[str, StructureCosts] = {"params": StructureCosts.of_parameters(sites, self, total=0)}
        self._handles = [handle for i, site in enumerate(sites) for handle in site.attach(self._value(i))]

    def _value(self, i: int):
        gate, size = self.gates[i], self.group_sizes[i]

        def value(training: bool) -> torch.Tensor:
            if self.mode in PLAN_MODES:
                g = self.mode_mask()[i].to(device=gate.log_alpha.device, dtype=gate.log_alpha.dtype)  # (G,)
            else:
                g = gate.value(self.mode, training)  # (G,)
            return g.repeat_interleave(size) if size > 1 else g  # (units,)

        return value

    def set_mode(self, mode: str) -> "HeadGates":
        """"sample" (noise while training, deterministic in eval), "deterministic" (the stretched sigmoid), "open"
        (all 1), or a plan's keep mask: "binary" (log_alpha > 0) or "expected_size" (``keep_mask``), each with the
        decoder's floor and the uniform shapes of ``plan``."""
        if mode not in MODES:
            raise ValueError(f"unknown gate mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode = mode
        return self

    @torch.no_grad()
    def mode_mask(self) -> list[torch.Tensor]:
        """Per site, the keep mask (G,) of the plan mode's rule, made again only when a log_alpha has changed."""
        key = (self.mode, tuple(gate.log_alpha._version for gate in self.gates))
        if self._mask is None or self._mask[0] != key:
            self._mask = (key, self.plan_mask(self.mode, note=False))
        return self._mask[1]

    def set_uniform(self, heads: bool = False, ffn: bool = False) -> "HeadGates":
        """Every plan keeps one head count per layer of each attention kind (``heads``), one FFN width per stack
        (``ffn``): ``gatedprune.structures.uniform``. Off (the default) leaves every plan as the rule keeps it."""
        self.uniform = uniform_kinds(self.kinds, heads, ffn)
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

    # ---- nesting: P(open) of a structure and of everything that holds it ------------------------------------------
    def p_open_nested(self, i: int) -> torch.Tensor:
        """P(open) of site i's gates times its layer's, where that layer is gated.  # (G,)"""
        p = self.gates[i].p_open()
        return p * self.gates[self.outer[i]].p_open() if self.outer[i] is not None else p

    def expected_open(self, group: str = "total") -> torch.Tensor:
        """Expected number of open structures of a group ("total": heads; or a kind), nesting-aware: a head of a gated
        layer counts P(head) x P(layer); units are counted one by one (a gate of ``ffn_group`` counts that many)."""
        return torch.stack([self.p_open_nested(i).sum() * self.group_sizes[i] for i in self.group(group)]).sum()

    def expected_params(self) -> torch.Tensor:
        """Expected number of kept prunable parameters (differentiable; see ``_Costs``)."""
        return self.costs["params"].expected(self)

    @property
    def prunable_params(self) -> int:
        """Parameters the gates can remove: whole gated layers, and the gated units of the other layers."""
        return self.costs["params"].prunable

    def set_costs(self, unit: str, costs: StructureCosts) -> "HeadGates":
        """What a plan costs in ``unit`` (one of ``COST_UNITS``), for the rule of that name."""
        if unit not in COST_UNITS:
            raise ValueError(f"unknown cost unit {unit!r}; allowed: {', '.join(COST_UNITS)}")
        self.costs[unit] = costs
        return self

    # ---- one flat view of every gate: (path, kind, layer, index) -------------------------------------------------
    def group(self, group: str) -> list[int]:
        """The sites of a budget group: "total" (every attention kind) or one kind; ``ValueError`` for one not gated."""
        if group != "total" and group not in self.kinds:
            allowed = ", ".join(k for k in ALL_KINDS if k in self.kinds)
            raise ValueError(f"{group!r} is not a gated kind; allowed: total, {allowed}")
        return [i for i, kind in enumerate(self.kinds)
                if (group == "total" and kind in ATTENTION_KINDS) or kind == group]

    def index(self) -> list[tuple[str, str, int, int]]:
        """(path, kind, layer, index) of every gate, in the order of ``log_alpha()``."""
        return [(path, kind, layer, j) for path, kind, layer, gate in zip(self.paths, self.kinds, self.layers, self.gates)
                for j in range(gate.num_heads)]

    @torch.no_grad()
    def log_alpha(self) -> torch.Tensor:
        """Every gate's ``log_alpha``, flat, on CPU.  # (N,)"""
        return torch.cat([gate.log_alpha.detach().cpu() for gate in self.gates])

    def per_site(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat per-gate tensor (N,) cut back into one (G,) tensor per site."""
        return list(flat.split([gate.num_heads for gate in self.gates]))

    def by_kind(self, values: list[torch.Tensor]) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """Per-site values regrouped: ``{kind: [(layer, values of that site), ...]}`` (a layer x unit picture)."""
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

        - ``layer_mean`` (Voita et al.'s code): per-site sum of P(open), averaged over gated sites
        - ``sum`` (Voita et al.'s paper formula): sum of P(open) over all gates
        - ``head_mean``: mean of P(open) over all gates (the expected fraction open)
        - ``params``: expected kept prunable parameters / prunable parameters, nesting-aware (lambda trades
          parameters, not counts: the default once a kind other than heads is gated)
        """
        if normalisation == "params":
            return self.expected_params() / self.prunable_params
        per_site = torch.stack([g.p_open().sum() for g in self.gates])  # (L,)
        if normalisation == "layer_mean":
            return per_site.mean()
        if normalisation == "sum":
            return per_site.sum()
        if normalisation == "head_mean":
            return per_site.sum() / self.num_gates
        raise ValueError(
            f"unknown penalty normalisation {normalisation!r}; allowed: {', '.join(PENALTY_NORMALISATIONS)}"
        )

    @property
    def num_heads(self) -> int:
        """Gated attention heads."""
        return sum(g.num_heads for g, kind in zip(self.gates, self.kinds) if kind in ATTENTION_KINDS)

    @property
    def num_gates(self) -> int:
        return sum(g.num_heads for g in self.gates)

    def kept(self, site: int) -> list[int]:
        """Gate indices of site ``site`` that the binary rule keeps (log_alpha > 0)."""
        return torch.nonzero(self.gates[site].binary()).flatten().tolist()

    # ---- gates -> plan ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def expected_counts(self) -> dict[str, int]:
        """Per gated kind, its expected number of open gates rounded, nested (a gate inside a gated layer counts
        P(gate) x P(layer)): the size CoFiPruning's deterministic mask keeps of each kind. A settled gate counts its
        decision, 1 or 0, where the budget's expected cost still counts its P(open): at log_alpha -10 that is about
        1e-4, which over thousands of closed units would round a kind up by one more than was decided."""
        held = [(g.log_alpha > 0).to(g.log_alpha.dtype) if p in self.settled else g.p_open()
                for p, g in zip(self.paths, self.gates)]
        sums = Counter()
        for i, kind in enumerate(self.kinds):
            outer = self.outer[i]
            sums[kind] += (held[i] * (held[outer] if outer is not None else 1)).sum().item()
        return {kind: int(math.floor(total + 0.5)) for kind, total in sums.items()}

    def keep_mask(self, rule: str = "binary", top_k: int | dict[str, int] | None = None) -> torch.Tensor:
        """Which gates a rule keeps, flat (N,), before nesting: ``binary`` keeps log_alpha > 0 (Voita et al.);
        ``top-k`` the ``top_k`` largest log_alpha of "total" (the heads), or per group with ``{kind: k}`` (k counts
        gates; groups it does not name follow the binary rule); ``expected_size`` is top-k with k of each kind
        ``expected_counts`` (CoFiPruning's deterministic mask). Ties: the earlier gate wins."""
        if rule not in PLAN_RULES:
            raise ValueError(f"unknown gate rule {rule!r}; allowed: {', '.join(RULES)}")
        if rule == "expected_size":
            if top_k is not None:
                raise ValueError("top_k is only used by rule='top-k'")
            rule, top_k = "top-k", self.expected_counts()
        if rule in COST_UNITS:
            if rule not in self.costs:
                raise ValueError(f"rule {rule!r}: these gates have no {rule} costs yet (HeadGates.set_costs)")
            return self.costs[rule].within(self, top_k)
        keep = torch.cat([gate.binary().detach().cpu().bool() for gate in self.gates])  # (N,)
        if rule == "binary":
            if top_k is not None:
                raise ValueError("top_k is only used by rule='top-k'")
            return keep
        site_of_gate = torch.repeat_interleave(torch.tensor([g.num_heads for g in self.gates]))  # (N,)
        # a structure ranks no higher than its layer: k is not spent inside layers the plan drops
        layer_scores = torch.stack([self.gates[o].log_alpha.detach().cpu()[0] if o is not None else torch.tensor(
            float("inf")) for o in self.outer])  # (sites,)
        scores = torch.minimum(self.log_alpha(), layer_scores[site_of_gate])  # (N,)
        for group, k in (dict(top_k) if isinstance(top_k, dict) else {"total": top_k}).items():
            members = torch.nonzero(torch.isin(site_of_gate, torch.tensor(self.group(group)))).flatten()
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= len(members):
                raise ValueError(f"rule 'top-k' needs 0 <= top_k <= {len(members)} (the gates of {group}), got {k!r}")
            ranked = members[torch.argsort(scores[members], descending=True, stable=True)]
            keep[ranked] = False
            keep[ranked[:k]] = True
        return keep

    def plan(self, rule: str = "binary", top_k: int | dict[str, int] | None = None, keep=None,
             note: bool = True) -> dict[str, list[int]]:
        """The plan a rule keeps (``plan_mask``): ``{attention module path: kept heads, feed-forward output projection
        path: kept units, stack's layers path: kept layers}``."""
        plan: dict[str, list[int]] = {}
        for i, kept in enumerate(self.plan_mask(rule, top_k, keep, note)):
            if self.structures[i] == "layer":
                plan.setdefault(self.layers_paths[self.kinds[i]], [])
                if kept.item():
                    plan[self.layers_paths[self.kinds[i]]].append(self.layers[i])
            else:
                size = self.group_sizes[i]
                plan[self.paths[i]] = [g * size + j for g in torch.nonzero(kept).flatten().tolist() for j in range(size)]
        return plan

    @torch.no_grad()
    def plan_mask(self, rule: str = "binary", top_k: int | dict[str, int] | None = None, keep=None,
                  note: bool = True) -> list[torch.Tensor]:
        """Per site, the gates a plan keeps (G,) bool: a rule's ``keep_mask`` (``keep``: a flat mask decided
        elsewhere), then the plan's own rules. A decoder whose every layer gate is closed keeps its most open layer,
        and says so. Kinds in ``self.uniform`` then keep one count per layer (``uniform.even_out``; rounded down
        under the params rule). Structures inside a layer the plan drops are kept here; the plan drops them."""
        round_down = keep is None and rule in COST_UNITS  # a cost budget stays met
        if rule == "expected_size":
            rule, top_k = "top-k", self.expected_counts()
        keep = self.keep_mask(rule, top_k) if keep is None else keep.clone()
        per_site = self.per_site(keep)
        for kind, path in self.layers_paths.items():
            sites = [i for i, k in enumerate(self.kinds) if k == kind]
            if KINDS[kind].stack == "decoder" and not any(per_site[i].item() for i in sites):
                best = max(sites, key=lambda i: self.gates[i].log_alpha.item())
                per_site[best][0] = True
                if note:
                    print(f"note: every decoder layer gate is closed; the plan keeps the most open one, layer "
                          f"{self.layers[best]} (log_alpha {self.gates[best].log_alpha.item():.3f})")
        if self.uniform:
            targets = top_k if rule == "top-k" and isinstance(top_k, dict) else None
            per_site = even_out(self, per_site, self.uniform, round_down, targets, note)
        return list(per_site)

    def dropped(self, plan: dict) -> set[tuple[str, int]]:
        """(stack, layer) of the layers a plan drops."""
        return {(self.stacks[i], self.layers[i]) for i, st in enumerate(self.structures)
                if st == "layer" and self.layers[i] not in plan.get(self.layers_paths[self.kinds[i]], [self.layers[i]])}

    @torch.no_grad()
    def fix_(self, plan: dict[str, list[int]]) -> "HeadGates":
        """Set the gates so that the binary rule keeps exactly ``plan`` (sites it does not name: unchanged), at
        log_alpha -10 or 10: settled, so each deterministic gate is 0 or 1 too (with the default stretch). A
        feed-forward gate is open when all its units are in the plan."""
        for i, (path, gate) in enumerate(zip(self.paths, self.gates)):
            if self.structures[i] == "layer":
                layers = plan.get(self.layers_paths[self.kinds[i]])
                if layers is not None:
                    gate.log_alpha.copy_(decided([self.layers[i] in layers]))
            elif path in plan:
                size, kept = self.group_sizes[i], set(plan[path])
                gate.log_alpha.copy_(decided([all(g * size + j in kept for j in range(size))
                                              for g in range(gate.num_heads)]))
        return self

    @torch.no_grad()
    def settle_(self, kinds, counts: dict[str, int] | None = None, note: bool = True) -> dict[str, list[int]]:
        """Decide the gates of ``kinds`` now and hold them: each at log_alpha 10 (open) or -10 (closed) as the
        expected-size plan keeps it (``plan_mask("expected_size")``, the decoder's floor included; ``counts``
        {kind: k}: those kinds keep their k most open gates instead), from here on (``clamp_`` puts them back
        after every step). Returns the layers kept per stack, for the kinds that are layers."""
        mask = self.plan_mask("top-k", {**self.expected_counts(), **(counts or {})}, note=False)
        kept: dict[str, list[int]] = {}
        for i, kind in enumerate(self.kinds):
            if kind in kinds and self.structures[i] == "layer" and mask[i].item():
                kept.setdefault(self.stacks[i], []).append(self.layers[i])
        self.hold_({self.paths[i]: mask[i] for i, kind in enumerate(self.kinds) if kind in kinds})
        if note:
            print("note: the gates of " + ", ".join(kinds) + " are settled and held: kept layers "
                  + "; ".join(f"{stack} {kept.get(stack, [])}" for stack in sorted({self.stacks[i] for i, k in
                                                                                 enumerate(self.kinds) if k in kinds})))
        return kept

    @torch.no_grad()
    def hold_(self, masks: dict[str, torch.Tensor]) -> None:
        """Decide the gates at each path of ``masks`` (a bool per gate: open or closed) and hold them there from
        now on: ``clamp_`` puts them back after every step, and the state a checkpoint keeps names them."""
        for path, kept in masks.items():
            self.settled[path] = decided(kept).tolist()
        self.clamp_()

    @torch.no_grad()
    def clamp_(self) -> None:
        for path, gate in zip(self.paths, self.gates):
            gate.clamp_()
            if path in self.settled:
                gate.log_alpha.copy_(torch.tensor(self.settled[path], dtype=gate.log_alpha.dtype))

    def extra_repr(self) -> str:
        counts = Counter(self.kinds)
        return ", ".join(f"{k}: {counts[k]} sites" for k in ALL_KINDS if k in counts) + f", {self.num_gates} gates"

    # the site layout travels with the weights, so a checkpoint says which module each gate belongs to
    # (and which gates are settled, so a resumed run holds them too)
    def get_extra_state(self) -> dict:
        return {"paths": self.paths, "kinds": self.kinds, "layers": self.layers, "settled": self.settled}

    def set_extra_state(self, state: dict) -> None:
        if state["paths"] != self.paths:
            raise ValueError(
                f"checkpoint gates belong to modules {state['paths'][:3]}..., this model's to {self.paths[:3]}..."
            )
        self.settled = {path: list(values) for path, values in (state.get("settled") or {}).items()}


def attach_gates(model: nn.Module, kinds=ATTENTION_KINDS, ffn_group: int = 1, **gate_options) -> HeadGates:
    """Gate every structure of the given kinds of ``model``; returns the module holding the gates.

    ``gate_options`` are the fields of ``GateOptions`` (temperature, stretch, eps, init_log_alpha, log_alpha_range);
    ``ffn_group`` gates that many contiguous feed-forward units together.
    """
    options = GateOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in gate_options.items()})
    gates = HeadGates(structure_sites(model, check_kinds(kinds)), options, ffn_group)
    gates.non_embedding_params = non_embedding_parameters(model)
    gates.costs["params"].total = gates.non_embedding_params
    return gates.to(next(model.parameters()).device)


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` less its embeddings: token and position embeddings outside the layers, and the
    output layer (tied ones counted once). A relative position bias, inside a layer, counts as non-embedding."""
    layers = {id(p) for path in probe(model).layers.values() for p in model.get_submodule(path).parameters()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)] + [model.get_output_embeddings()]
    excluded = {id(p) for m in embeddings if m is not None for p in m.parameters()} - layers
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)
