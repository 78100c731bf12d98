"""The literature's methods that decide which heads go by scoring a trained model, with no gate training.

Each is a config group option with its own ``_target_`` (``pruning=michel``, ``pruning=astar``, ``pruning=random``)
and produces plans, ``{attention module path: kept heads}``, one per level (a head count it stops at); the plans go
through the same export, verification and report as the gates' (``gatedprune.methods.plan_run``). What the methods
measure (the model with some heads masked) comes from a ``HeadProbe``, so they never touch the model themselves.

- ``Michel`` (Michel et al. 2019): rank heads by importance |head output . dL/d head output| (per token,
  layer-normalised), remove the least important in steps of 10% of all heads, optionally re-estimating after each.
- ``AStar`` (Parnami et al. 2021): remove heads one at a time, the cheapest first, while the validation metric stays
  within a budget; a head's cost in the previous round is a lower bound, which spares most evaluations.
- ``Random`` (``gatedprune.methods.random_draw``): keep structures chosen at random with a seed; the floor every
  method must beat. Michel and A* score heads only and refuse feed-forward and layer kinds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from gatedprune.methods.base import Method
from gatedprune.methods.gated import GatedPruning
from gatedprune.methods.importance import rank_heads
from gatedprune.methods.levels import Head, HeadProbe, Level, head_counts
from gatedprune.methods.plan_run import check_dense, load_weights, run
from gatedprune.structures.kinds import ATTENTION_KINDS


@dataclass
class PlanMethod(Method):
    """Shared by the methods that score a trained model. Its run scores the model, finds the levels and ships each
    (``gatedprune.methods.plan_run``); ``distill``: finetune.distill=true distils each pruned model from the unpruned
    one with these settings (alpha or hidden > 0)."""

    name: ClassVar[str] = "plan"
    needs_trained_model: ClassVar[bool] = True
    loads_checkpoint_itself: ClassVar[bool] = False  # the weights are loaded at set-up (prepare)
    heads_only: ClassVar[bool] = True  # it scores heads: a feed-forward or layer kind is refused
    eval_pairs: int = 200  # the fixed validation subset a method measures on (the shortest sources first)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_pairs < 1:
            raise ValueError(f"pruning.eval_pairs={self.eval_pairs}; allowed: an integer >= 1")
        others = [kind for kind in self.kinds if kind not in ATTENTION_KINDS]
        if self.heads_only and others:
            raise ValueError(f"pruning={self.name} scores attention heads only; allowed kinds: "
                             f"{', '.join(ATTENTION_KINDS)} (pruning.kinds names {', '.join(others)})")

    # ---- the run (gatedprune.methods.base.Method) ------------------------------------------------------------------
    def check_export(self, export) -> None:
        if not export.enabled:
            raise ValueError(f"pruning={self.name} with export.enabled=false; allowed: export.enabled=true (its "
                             "levels are exported to <run>/levels/<heads>_heads)")
        if export.deploy_formats():
            raise ValueError(f"export.formats={list(export.formats)} with pruning={self.name}, whose levels are "
                             f"exported as hf only; allowed: [hf] (convert a level with gatedprune-export "
                             f"<run>/levels/<level>/pruned OUT --format ...)")

    def check_checkpoint(self, path: Path, saved: dict) -> None:
        check_dense(path, saved)

    def checkpoint_kinds(self, saved: dict) -> tuple[str, ...]:
        return saved["gate_kinds"]  # it takes the weights only: the gates the checkpoint has are what must match

    def gating(self) -> GatedPruning:
        # the structures are gated only to be masked: the gates' own training settings do not apply. One object, so
        # the cost-fit directories train.py adds to it (a fork's source) are there when the method costs its plans
        if getattr(self, "_gating", None) is None:
            self._gating = GatedPruning(kinds=self.kinds, ffn_group=self.ffn_group, distill=self.distill)
        return self._gating

    def prepare(self, module, saved: dict | None) -> None:
        self.check(module.gates.num_heads)
        load_weights(module, saved)  # the file read once, at set-up

    def check_trainer(self, trainer) -> None:
        if trainer.world_size > 1:
            raise ValueError(f"pruning={self.name} runs in one process; allowed: trainer.devices=1 (got "
                             f"{trainer.world_size} processes)")

    def run(self, session) -> dict:
        return run(session, self)

    # ---- levels ------------------------------------------------------------------------------------------------
    def check(self, total: int) -> None:
        """Refuse settings that do not fit a model with ``total`` gated heads (called at set-up)."""
        for name in ("heads", "min_heads"):
            if getattr(self, name, None) is not None:
                head_counts(getattr(self, name), total, f"pruning.{name}")

    def levels(self, probe: HeadProbe) -> list[Level]:
        raise NotImplementedError

    def choose_by_bleu(self) -> bool:
        """Whether ``choose`` needs every level's validation BLEU (else every level is exported)."""
        return False

    def choose(self, scored: list[tuple[Level, float]], dense_bleu: float) -> list[Level]:
        """The levels to export, given each level's validation BLEU and the unpruned model's."""
        return [level for level, _ in scored]

    def describe(self) -> dict:
        """The method's settings for metrics.json."""
        return {"name": self.label(), **asdict(self)}

    def label(self) -> str:
        """The method's name in sweep tables and plots."""
        return self.name


@dataclass
class Michel(PlanMethod):
    """Iterative pruning by importance: each level removes ``step`` x all gated heads, down to ``min_heads``, or the
    levels are the head counts ``heads`` names. ``reestimate``: importance again on the model of every level."""

    name: ClassVar[str] = "michel"
    step: float = 0.1
    min_heads: int | float = 0
    heads: list | int | float | None = None
    reestimate: bool = False
    layer_norm_exponent: float | None = 2.0
    max_bleu_loss: float | None = None  # export only the smallest level within this validation BLEU of the dense model

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.step <= 1:
            raise ValueError(f"pruning.step={self.step}; allowed: a fraction of all gated heads in (0, 1]")
        if self.max_bleu_loss is not None and not self.max_bleu_loss >= 0:
            raise ValueError(f"pruning.max_bleu_loss={self.max_bleu_loss}; allowed: null or a number >= 0")

    def check(self, total: int) -> None:
        super().check(total)
        if not self.schedule(total):
            raise ValueError(f"pruning.min_heads={self.min_heads} leaves no level to prune to (the model has {total} "
                             "gated heads); allowed: fewer heads than that")

    def schedule(self, total: int) -> list[int]:
        """Heads kept at each level, largest first."""
        if self.heads is not None:
            return head_counts(self.heads, total, "pruning.heads")
        floor = head_counts(self.min_heads, total, "pruning.min_heads")[0]
        size = max(1, round(self.step * total))
        return sorted({max(floor, total - size * i) for i in range(1, math.ceil((total - floor) / size) + 1)},
                      reverse=True)

    def levels(self, probe: HeadProbe) -> list[Level]:
        kept = list(probe.heads)
        estimates = 1
        order = rank_heads(probe.importance(kept, self.layer_norm_exponent))  # least important first
        levels = []
        for count in self.schedule(len(kept)):
            if self.reestimate and levels:  # the heads left, ranked on the model as it is now
                order = rank_heads(probe.importance(kept, self.layer_norm_exponent))
                estimates += 1
            alive = set(kept)
            order = [head for head in order if head in alive]
            kept = sorted(order[len(order) - count:]) if count else []
            levels.append(Level(count, kept, {"importance_estimates": estimates}))
        return levels

    def choose_by_bleu(self) -> bool:
        return self.max_bleu_loss is not None

    def choose(self, scored: list[tuple[Level, float]], dense_bleu: float) -> list[Level]:
        """The smallest level within ``max_bleu_loss`` of the dense model's validation BLEU."""
        within = [level for level, bleu in scored if dense_bleu - bleu <= self.max_bleu_loss]
        return within[-1:]

    def label(self) -> str:
        return "michel (re-estimated)" if self.reestimate else "michel"


@dataclass
class AStar(PlanMethod):
    """Greedy removal under a budget on the validation metric, with last round's costs as lower bounds.

    The cost of removing a head is how much the metric gets worse (loss up, or BLEU down); a head whose removal
    improves it costs 0. Heads go one at a time, the cheapest first, while the summed costs stay within ``budget``
    (so the metric never ends more than ``budget`` worse than the unpruned model's), down to ``min_heads``.
    ``heads`` names head counts on the way to record as levels; the last level is where the search stopped.
    """

    name: ClassVar[str] = "astar"
    metric: str = "loss"
    budget: float | None = 0.5  # how much worse the metric may end; None: no budget, down to min_heads
    min_heads: int | float = 0
    heads: list | int | float | None = None
    lazy: bool = True  # false: exhaustive greedy (every head evaluated every round), the reference it is counted against

    METRICS: ClassVar[tuple[str, ...]] = ("loss", "bleu")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metric not in self.METRICS:
            raise ValueError(f"pruning.metric={self.metric!r}; allowed: {', '.join(self.METRICS)}")
        if self.budget is not None and not self.budget >= 0:
            raise ValueError(f"pruning.budget={self.budget}; allowed: null or a number >= 0")

    def levels(self, probe: HeadProbe) -> list[Level]:
        worse = probe.loss if self.metric == "loss" else lambda kept: -probe.bleu(kept)  # higher is worse
        total = len(probe.heads)
        floor = head_counts(self.min_heads, total, "pruning.min_heads")[0]
        marks = set(head_counts(self.heads, total, "pruning.heads")) if self.heads is not None else set()
        floor = max(floor, min(marks, default=floor))
        path = search(probe.heads, worse, self.budget, floor, lazy=self.lazy)
        levels = []
        for count in sorted(marks | {path.kept_counts[-1]}, reverse=True):
            if count not in path.kept_counts:  # the budget ran out before this many heads were left
                continue
            i = path.kept_counts.index(count)
            kept = sorted(set(probe.heads) - set(path.removed[:i]))
            levels.append(Level(count, kept, {
                "metric": self.metric, "metric_change": path.changes[i], "budget_spent": path.spent[i],
                "budget": self.budget, "evaluations": path.evaluations[i],
                "exhaustive_evaluations": path.exhaustive[i],
                **({"stopped_by": path.stopped_by} if i == len(path.kept_counts) - 1 else {}),
            }))
        return levels

    def label(self) -> str:
        return "astar" if self.lazy else "greedy"


@dataclass
class SearchPath:
    """Heads in the order the search removed them, and per step (index i: after i removals) what it had measured."""

    removed: list[Head]
    kept_counts: list[int]
    changes: list[float]  # metric now minus the unpruned model's (positive: worse)
    spent: list[float]  # summed costs
    evaluations: list[int]  # model evaluations so far, the unpruned model's included
    exhaustive: list[int]  # what exhaustive greedy needs for the same steps
    stopped_by: str


def search(heads: list[Head], worse: Callable[[list[Head]], float], budget: float | None, floor: int,
           lazy: bool = True) -> SearchPath:
    """Remove heads one at a time, the cheapest first, while the summed costs stay within ``budget``.

    ``worse(kept)`` is the metric with only ``kept`` heads, higher is worse. With ``lazy``, a head's cost measured
    in an earlier round is its lower bound now (costs grow as heads go, Parnami et al.'s heuristic): the heads are
    evaluated cheapest bound first, and a round ends as soon as no bound can beat the best cost found, or no bound
    fits what is left of the budget. Without ``lazy``, every head is evaluated every round (exhaustive greedy).
    Ties go to the head listed first, as in exhaustive greedy.
    """
    kept = list(heads)
    base = current = worse(kept)
    evaluations = exhaustive = 1
    bound = dict.fromkeys(heads, 0.0)
    path = SearchPath([], [len(kept)], [0.0], [0.0], [evaluations], [exhaustive], "min_heads")
    remaining = math.inf if budget is None else budget
    while len(kept) > floor:
        exhaustive += len(kept)
        queue = [(bound[h], i, h) for i, h in enumerate(kept)]  # i: ties go to the earlier head
        heapq.heapify(queue)
        best = None  # (cost, index, head, metric value)
        while queue:
            low, i, head = heapq.heappop(queue)
            if lazy and (low > remaining or (best is not None and (low, i) > best[:2])):
                break  # no head left in the queue can fit the budget, or beat (or tie with an earlier) the best one
            value = worse([h for h in kept if h != head])
            evaluations += 1
            bound[head] = cost = max(0.0, value - current)
            if best is None or (cost, i) < best[:2]:
                best = (cost, i, head, value)
        if best is None or best[0] > remaining:  # this round's evaluations proved it: they count for where it stops
            path.stopped_by = "budget"
            path.evaluations[-1], path.exhaustive[-1] = evaluations, exhaustive
            break
        cost, _, head, current = best
        remaining -= cost
        kept.remove(head)
        path.removed.append(head)
        path.kept_counts.append(len(kept))
        path.changes.append(current - base)
        path.spent.append(path.spent[-1] + cost)
        path.evaluations.append(evaluations)
        path.exhaustive.append(exhaustive)
    return path

