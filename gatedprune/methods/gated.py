"""Pruning methods that train gates: what each adds to the loss, and which rule turns its gates into a plan.

A method is a config group option with its own ``_target_`` (``pruning=l0``, ``pruning=l0_budget``); the Lightning
module asks it for the penalty of a gated step and the trainer asks it for the export rule, so neither branches on
a method's name. What every gated method shares (the attention kinds gated, the dense phase, the gates' own
learning rate and hard-concrete constants) lives in ``GatedPruning``.

- ``L0`` (Voita et al. 2019): loss + ``l0_lambda`` x the expected number of open heads; export keeps
  ``log_alpha > 0``.
- ``L0Budget`` (Wang et al. 2020, CoFiPruning): a Lagrangian drives the expected open heads to ``target_heads``;
  export keeps exactly that many (top-k).

``uniform_heads`` / ``uniform_ffn`` (from ``Method``) shape either method's plan: every layer of a kind keeps the same
count (``gatedprune.structures.uniform``), set on the gates when they are built (``build``), so the export, the
reports and every other caller of ``HeadGates.plan`` see the same plan. Under ``L0`` it is an export rule only; under
``L0Budget`` the budget ties the layers too (``gatedprune.methods.budget``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from gatedprune.methods.base import Method
from gatedprune.costs.build import gate_costs
from gatedprune.costs.workload import Workload
from gatedprune.methods.budget import CostBudget, HeadBudget, check_cost_options, resolve_targets
from gatedprune.methods.settling import (check_depth, check_depth_fits, check_inside, check_settling, check_widths,
                                         settle_layers, settle_widths)
from gatedprune.shipping.export_dir import check_out_dir
from gatedprune.structures.hard_concrete import GateOptions
from gatedprune.structures.head_gates import MODES, PENALTY_NORMALISATIONS, HeadGates
from gatedprune.structures.kinds import ATTENTION_KINDS
from gatedprune.structures.uniform import per_layer_count, uniform_kinds
from gatedprune.training.checkpoints import untrained_beyond
from gatedprune.utils import check_numbers


@dataclass
class GatedPruning(Method):
    """What is gated, when gating starts, and the gates' own settings. Its run trains the gates, then ships the
    plan their export rule keeps (``gatedprune.methods.gated_run``)."""

    name: ClassVar[str] = "gated"
    loads_checkpoint_itself: ClassVar[bool] = True  # trainer.fit reads a resumed checkpoint (weights, optimiser)
    shapes_plans: ClassVar[bool] = True  # uniform_heads / uniform_ffn: the plan HeadGates.plan keeps
    shows_reference: ClassVar[bool] = True  # one shipped model, one final table (methods.gated_run)
    start_step: int = 0  # dense phase: gates open and no penalty before this optimiser step
    gate_lr: float = 0.1
    # validation's gates: "binary" (log_alpha > 0) or "expected_size" (CoFi's deterministic mask) with the plan's
    # floor and shapes, the function that rule's export computes; or a soft mode ("deterministic")
    eval_gate_mode: str = "binary"
    # end the gated phase once the plan export would keep (export_rule) has not changed for this many validations in
    # a row, counted from settles_from(); None: run to trainer.max_steps. Every gated validation records how many
    # heads changed side and how many gates are unsettled
    stop_when_stable: int | None = None
    gates: GateOptions = field(default_factory=GateOptions)  # the hard-concrete constants
    # anneal the gates' temperature geometrically from gates.temperature to this over the gated phase (None: fixed);
    # a lower temperature makes the samples closer to 0 or 1, so training sees the binary plan's noise less
    final_temperature: float | None = None
    # at this gated step, decide the layer gates by the expected size (round(sum of P(open)) per stack, the most open
    # ones) and hold them for the rest of the gated phase, so the widths meet the budget around layers that are
    # settled (layers decided apart from widths, as NASH does); null: the layer gates train to the end
    settle_layers_at: int | None = None
    settle_depth: dict[str, int] | None = None  # {stack: layers} kept when they settle (methods.settling); null: expected
    settle_keep: str = "open"  # which layers a settled stack keeps: its most open gates, or bottom (its first layers)
    # distill (from Method): distillation from the dense model while gating

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.gates, dict):  # from a config file
            check_numbers("pruning.gates", GateOptions, self.gates)
            self.gates = GateOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.gates.items()})
        if self.start_step < 0:
            raise ValueError(f"pruning.start_step={self.start_step} is negative; allowed: an integer >= 0")
        if self.stop_when_stable is not None and self.stop_when_stable < 1:
            raise ValueError(f"pruning.stop_when_stable={self.stop_when_stable}; allowed: null or an integer >= 1")
        if self.final_temperature is not None and not (0 < self.final_temperature < math.inf):
            raise ValueError(f"pruning.final_temperature={self.final_temperature}; allowed: null or a number > 0")
        check_settling(self.settle_layers_at, self.settle_depth, self.kinds, self.settle_keep)
        self.settle_depth = dict(self.settle_depth) if self.settle_depth is not None else None
        self._gated_steps: int | None = None  # set by check_schedule: trainer.max_steps - start_step
        if self.eval_gate_mode not in MODES:
            raise ValueError(f"pruning.eval_gate_mode={self.eval_gate_mode!r}; allowed: {', '.join(MODES)}")
        uniform_kinds(self.kinds, self.uniform_heads, self.uniform_ffn)  # refuses an option with nothing to shape
        self.cost_dirs: list[Path] = []  # where cost fits are cached and looked up (train.py adds a fork's source)

    def gate_options(self) -> GateOptions:
        return self.gates

    # ---- the run (gatedprune.methods.base.Method) ------------------------------------------------------------------
    def check_outputs(self, export, tuning, run_dir: Path):
        tuning = super().check_outputs(export, tuning, run_dir)
        if export.enabled:  # the other methods export into <run>/levels, by their own rule
            export.check_rule()
            check_out_dir(Path(export.out_dir), protected=[run_dir])
            if tuning.steps:
                check_out_dir(Path(tuning.out_dir), protected=[run_dir, Path(export.out_dir)])
        return tuning

    def gating(self) -> GatedPruning:
        return self

    def checkpoint_kinds(self, saved: dict) -> tuple[str, ...]:
        """A heads-only checkpoint (every ``dense.ckpt`` written before other kinds existed) forks into a run that
        gates its heads and more: the new gates start fresh (``add_new_gates``). A checkpoint gated on more kinds
        than this run, whose other gates never trained (a ``dense.ckpt`` of the every-kind default), forks into it:
        those gates are dropped (``drop_unused_gates``)."""
        heads = tuple(k for k in self.kinds if k in ATTENTION_KINDS)
        kinds = tuple(saved.get("gate_kinds", ()))
        if kinds == heads and heads != self.kinds:
            return heads
        if set(self.kinds) < set(kinds) and untrained_beyond(saved, self.kinds):
            return kinds
        return self.kinds

    def run(self, session) -> dict:
        from gatedprune.methods.gated_run import fit_and_ship

        return fit_and_ship(self, session)

    # ---- what the Lightning module asks ------------------------------------------------------------------------

    def build(self, gates: HeadGates, model: nn.Module) -> nn.Module | None:
        """Trainable state of the method beside the gates (a Lagrangian's multipliers), or None. Called once the
        gates are attached to ``model``: it also gives them the plan's shape (``uniform_heads``, ``uniform_ffn``)."""
        gates.set_uniform(self.uniform_heads, self.uniform_ffn)
        check_depth(self.settle_depth, gates)
        return None

    def before_step(self, gates: HeadGates, state: nn.Module | None, gated_step: int) -> None:
        """Called before each gated step, with ``build``'s state: the layer gates settle at ``settle_layers_at``
        (``methods.settling``)."""
        settle_layers(gates, self.settle_layers_at, self.settle_depth, gated_step, self.settle_keep)

    def penalty(self, gates: HeadGates, state: nn.Module | None, gated_step: int) -> tuple[torch.Tensor, dict]:
        """The term added to the cross-entropy at a gated step, and what to log about it."""
        raise NotImplementedError

    def export_rule(self, state: nn.Module | None) -> tuple[str, int | dict | None]:
        """(rule, top_k) for ``HeadGates.plan``."""
        return "binary", None

    def rule_key(self, state: nn.Module | None) -> list:
        """The export rule's settings, not the gates' values: a resumed run compares them before loading gates."""
        return list(self.export_rule(state))

    def param_groups(self, state: nn.Module | None) -> list[dict]:
        """Optimiser groups of the method's own state, after the model's and the gates' (none by default)."""
        return []

    def migrate_checkpoint(self, checkpoint: dict, state: nn.Module | None, prefix: str) -> None:
        """Fit a checkpoint another method wrote (an l0 run's dense.ckpt into l0_budget, or back) to this one.

        The model's and the gates' weights and optimiser groups carry over; the method's own state (saved under
        ``prefix``, with the optimiser groups of ``param_groups`` after the model's and the gates') starts fresh
        where the source had none or had it of other shapes, and goes where this method has none.
        """
        state_dict = checkpoint["state_dict"]
        saved = [k for k in state_dict if k.startswith(prefix)]
        fresh = {f"{prefix}{k}": v for k, v in state.state_dict().items()} if state is not None else {}
        groups_now = self.param_groups(state)
        expected = 2 + len(groups_now)  # the model's, the gates', then the method's (training.module)
        regrouped = saved and fresh and any(state_dict[k].shape != v.shape for k, v in fresh.items() if k in state_dict)
        if regrouped:  # e.g. a budget over other groups (one total, or one per kind): its state starts afresh
            state_dict.update(fresh)
            for optimizer in checkpoint.get("optimizer_states", []):
                for group in optimizer["param_groups"][2:]:
                    for index in group["params"]:
                        optimizer["state"].pop(index, None)
        if state is not None and not saved:
            state_dict.update(fresh)
        elif state is None:
            for key in saved:
                del state_dict[key]
        for optimizer in checkpoint.get("optimizer_states", []):
            groups = optimizer["param_groups"]
            while len(groups) > expected:
                for index in groups.pop()["params"]:
                    optimizer["state"].pop(index, None)
            first = sum(len(group["params"]) for group in groups)
            for wanted in groups_now[len(groups) - 2:]:
                count = len(wanted["params"])
                groups.append({**groups[1], "params": list(range(first, first + count)), "lr": wanted["lr"],
                               "initial_lr": wanted["lr"], "weight_decay": wanted["weight_decay"]})
                first += count
        # the scheduler's rates for these groups are this run's (GatedSeq2Seq._take_own_learning_rates)
        for scheduler in checkpoint.get("lr_schedulers", []):
            if "lr_lambdas" in scheduler:
                scheduler["lr_lambdas"] = (scheduler["lr_lambdas"] + [None] * len(groups_now))[:expected]

    def settles_from(self) -> int:
        """Gated steps before which the plan is still meant to move, so ``stop_when_stable`` does not count it."""
        return 0

    def check_schedule(self, max_steps: int | None) -> None:
        """Refuse a schedule the method cannot work in, and note the gated phase's length (called at set-up with
        ``trainer.max_steps``)."""
        self._gated_steps = max_steps - self.start_step if max_steps and max_steps > 0 else None
        # a run that gates nothing (a dense run: start_step past max_steps) has no layers to settle
        gating = self._gated_steps is not None and self._gated_steps > 0
        if gating:
            steps = {name: getattr(self, name, None) for name in ("settle_layers_at", "settle_widths_at")}
            check_inside(steps, self._gated_steps, max_steps, self.start_step)
        if self.final_temperature is not None and not self._gated_steps:
            raise ValueError(f"pruning.final_temperature={self.final_temperature} anneals over the gated phase, which "
                             f"has no end (trainer.max_steps={max_steps}); allowed: a trainer.max_steps > "
                             f"pruning.start_step")

    def temperature(self, gated_step: int) -> float:
        """The gates' temperature at a gated step: ``gates.temperature``, annealed geometrically to
        ``final_temperature`` at the end of the gated phase when that is set."""
        start = self.gates.temperature
        if self.final_temperature is None or not self._gated_steps or self._gated_steps < 1:
            return start
        progress = min(1.0, gated_step / self._gated_steps)
        return start * (self.final_temperature / start) ** progress

    def describe(self, state: nn.Module | None) -> dict:
        """The method's own settings for metrics.json (keys shared by all methods, None where they do not apply)."""
        return {"l0_lambda": None, "penalty_normalisation": None, "target_heads": None, **NO_COST_TARGET}


@dataclass
class L0(GatedPruning):
    """Cross-entropy + ``l0_lambda`` x the expected number of open heads (``penalty_normalisation``), or of kept
    parameters (``params``, the default once a kind other than attention heads is gated)."""

    l0_lambda: float = 0.1
    penalty_normalisation: str | None = None  # None: layer_mean for heads only, params once other kinds are gated

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.penalty_normalisation is None:
            heads_only = all(kind in ATTENTION_KINDS for kind in self.kinds)
            self.penalty_normalisation = "layer_mean" if heads_only else "params"
        if not self.l0_lambda >= 0:
            raise ValueError(f"pruning.l0_lambda={self.l0_lambda} is negative; allowed: a number >= 0")
        if self.penalty_normalisation not in PENALTY_NORMALISATIONS:
            raise ValueError(
                f"pruning.penalty_normalisation={self.penalty_normalisation!r}; allowed: {', '.join(PENALTY_NORMALISATIONS)}"
            )

    def penalty(self, gates: HeadGates, state: nn.Module | None, gated_step: int) -> tuple[torch.Tensor, dict]:
        penalty = gates.penalty(self.penalty_normalisation)
        return self.l0_lambda * penalty, {"train/penalty": penalty}

    def describe(self, state: nn.Module | None) -> dict:
        return {"l0_lambda": self.l0_lambda, "penalty_normalisation": self.penalty_normalisation, "target_heads": None,
                **NO_COST_TARGET}


COST_TARGETS = ("target_params", "target_flops", "target_latency")  # fractions of the dense model's cost
NO_COST_TARGET = dict.fromkeys(COST_TARGETS)


@dataclass
class L0Budget(GatedPruning):
    """An exact budget, one target per run: ``target_heads`` (a count, a fraction of the gated heads, or
    ``{kind: count or fraction}``; half the heads when no target is set), or the fraction of the dense model's cost
    kept: ``target_params`` (non-embedding parameters), ``target_flops`` or ``target_latency`` (of one generate() call
    of ``workload``, ``gatedprune.costs``)."""

    target_heads: int | float | dict | None = None
    target_params: float | None = None
    target_flops: float | None = None
    target_latency: float | None = None
    # what FLOPs and latency are predicted for (gatedprune.costs.workload.Workload): lengths, batch, beams, runtime
    workload: dict = field(default_factory=lambda: asdict(Workload()))
    cost_dir: str | None = None  # where a latency fit is cached (the run's checkpoints): reused by forks
    target_warmup_steps: int = 100  # gated steps over which the target ramps from all heads to its value
    lagrangian_lr: float = 0.05
    # a cost budget's lambda1 kept >= 0, so it cannot wind below zero while the cost sits under the target and then
    # open the gates at once (docs/gates.md 0k); the quadratic term still draws a cost under the target towards it
    target_ceiling: bool = False
    # a cost budget's export: true, the most open structures that fit the target; false, the gated model's own
    # eval-mode mask (eval_gate_mode: binary or expected_size) wherever it fits the target, so the export is the
    # model validated (the fill where it does not fit)
    export_fill: bool = True
    # at this gated step (settle_layers_at or later) decide every gate as the fill would ship it then (the most open
    # structures that fit the target) and hold it: the rest of the gated phase trains the model that ships (0l)
    settle_widths_at: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        given = {name: getattr(self, name) for name in ("target_heads", *COST_TARGETS) if getattr(self, name) is not None}
        if len(given) > 1:
            listed = " and ".join(f"pruning.{k}={v}" for k, v in given.items())
            raise ValueError(f"{listed}: a budget takes one target; allowed: one of them, the others null")
        for name in COST_TARGETS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1):
                raise ValueError(f"pruning.{name}={value}; allowed: a fraction in (0, 1) of the dense model's cost to keep")
        if not given:
            self.target_heads = 0.5
        self.workload = Workload.of(self.workload)
        if self.workload.table is not None and self.target_latency is None:
            raise ValueError(f"pruning.workload.table={self.workload.table} is a latency fit, which only "
                             "pruning.target_latency uses; allowed: with target_latency, or table null")
        self.cost_dirs = [Path(self.cost_dir)] if self.cost_dir else []
        check_cost_options(self)
        check_widths(self.settle_widths_at, self.settle_layers_at)
        if self.target_warmup_steps < 0:  # a negative ramp would act as none without a word
            raise ValueError(f"pruning.target_warmup_steps={self.target_warmup_steps} is negative; allowed: an "
                             "integer >= 0")

    @property
    def cost_unit(self) -> str | None:
        """params, flops or latency when the target is a cost; None for a head budget."""
        return next((name.removeprefix("target_") for name in COST_TARGETS if getattr(self, name) is not None), None)

    def build(self, gates: HeadGates, model: nn.Module) -> HeadBudget | CostBudget:
        super().build(gates, model)  # the plan's shape first: the budget ties the layers of the uniform kinds
        unit = self.cost_unit
        if unit is not None:
            self.cost_source = gate_costs(unit, model, gates, self.workload, self.cost_dirs)
            dense_run = self._gated_steps is not None and self._gated_steps < 1  # its floor cuts nothing: no refusal
            budget = CostBudget(gates, unit, getattr(self, f"target_{unit}"), self.target_warmup_steps, dense_run,
                                ships=None if self.export_fill else self.eval_gate_mode, ceiling=self.target_ceiling)
            if not dense_run:
                check_depth_fits(self.settle_depth, gates, budget)
            return budget
        targets = resolve_targets(self.target_heads, gates)
        for kind, target in targets.items():
            layers = gates.kinds.count(kind)
            if kind in gates.uniform and target % layers:
                each = per_layer_count(target, layers)
                print(f"note: pruning.target_heads={target} for {kind} over its {layers} layers: uniform_heads keeps "
                      f"{each} per layer ({each * layers} heads)")
        return HeadBudget(gates, targets, self.target_warmup_steps)

    def before_step(self, gates: HeadGates, state: HeadBudget | CostBudget, gated_step: int) -> None:
        super().before_step(gates, state, gated_step)  # the layers first: the widths are decided around them
        settle_widths(gates, self.settle_widths_at, gated_step, state)  # a cost budget: check_cost_options

    def param_groups(self, state: HeadBudget | CostBudget) -> list[dict]:
        # lambda1, lambda2: their gradients are negated (HeadBudget), so this is ascent
        return [{"params": list(state.parameters()), "weight_decay": 0.0, "lr": self.lagrangian_lr}]

    def penalty(self, gates: HeadGates, state: HeadBudget | CostBudget, gated_step: int) -> tuple[torch.Tensor, dict]:
        penalty = state(gated_step)
        logs = {"train/lagrangian": penalty, "train/lambda1": state.lambda1[: len(state.groups)].sum()}  # not the ties'
        if isinstance(state, CostBudget):  # how far the expected cost has come down, beside where the ramp has it
            logs[f"train/expected_{state.unit}"] = state.expected_fraction().detach().squeeze()
            logs[f"train/target_{state.unit}"] = state.target_fraction(gated_step).squeeze()
        return penalty, logs

    def export_rule(self, state: HeadBudget | CostBudget) -> tuple[str, dict | int | float]:
        if isinstance(state, CostBudget):  # the most open structures that fit, or the eval-mode mask (export_fill)
            return state.export_rule()
        return "top-k", state.targets  # the budget, met exactly per budget group

    def rule_key(self, state: HeadBudget | CostBudget) -> list:
        return state.rule_key if isinstance(state, CostBudget) else super().rule_key(state)

    def check_outputs(self, export, tuning, run_dir: Path):
        # a dense run's export would cut untrained gates to the target
        if export.enabled and self._gated_steps is not None and self._gated_steps < 1:
            raise ValueError(
                f"pruning=l0_budget with no gated step (trainer.max_steps={self.start_step + self._gated_steps}, "
                f"pruning.start_step={self.start_step}) has nothing to export; allowed: trainer.max_steps > "
                "pruning.start_step, or export.enabled=false (a dense run)"
            )
        return super().check_outputs(export, tuning, run_dir)

    def settles_from(self) -> int:  # while the target ramps down (or until the widths are held) the plan still moves
        return max(self.target_warmup_steps, self.settle_widths_at or 0)

    def check_schedule(self, max_steps: int | None) -> None:
        """A target ramp longer than the gated phase never reaches the budget: it is cut to the first half of the gated
        phase (the second holds the target), and the run says so. A run with no gated step is dense (check_outputs)."""
        super().check_schedule(max_steps)
        gated_steps = self._gated_steps  # None with no max_steps; < 1 in a dense run
        if gated_steps is not None and 0 < gated_steps < self.target_warmup_steps:
            print(
                f"warning: pruning.target_warmup_steps={self.target_warmup_steps} is longer than the gated phase "
                f"({gated_steps} steps: trainer.max_steps={max_steps} - pruning.start_step={self.start_step}); the "
                f"target ramps over {gated_steps // 2} steps instead"
            )
            self.target_warmup_steps = gated_steps // 2

    def describe(self, state: HeadBudget | CostBudget | None) -> dict:
        costs = {name: getattr(self, name) for name in COST_TARGETS}
        targets = None if self.cost_unit is not None else state.targets if state is not None else self.target_heads
        return {"l0_lambda": None, "penalty_normalisation": None, "target_heads": targets, **costs}


def method_settings(method: GatedPruning) -> dict:
    """The method's settings as plain data (for the checkpoint's hyperparameters)."""
    return {"_target_": f"{type(method).__module__}.{type(method).__qualname__}", **asdict(method)}
