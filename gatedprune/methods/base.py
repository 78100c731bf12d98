"""What every pruning method is: a config option (``pruning=<name>``, its own ``_target_``) that runs itself.

``train.py`` composes the run and calls the method's hooks in this order; it never asks which method it holds:

1. ``check_schedule(trainer.max_steps)`` and ``check_outputs(export, finetune, run_dir)`` (which asks
   ``check_export``): settings the method cannot work with are refused before anything heavy runs;
2. ``needs_trained_model``: a method that scores a trained model is refused without one;
3. ``check_checkpoint(path, saved)`` and ``checkpoint_kinds(saved)``: what of a checkpoint it accepts;
4. ``gating()``: the gates the Lightning module is built with (``GatedPruning`` settings);
5. ``prepare(module, saved)`` once the module exists, then ``check_trainer(trainer)``;
6. ``run(session)``: fit then ship (the gates), or score levels then ship (the baselines); returns the metrics.

A new method is a dataclass beside the others and a YAML file under ``conf/pruning/``: no edit to ``train.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from gatedprune.structures.kinds import ATTENTION_KINDS, LAYER_KINDS, check_kinds
from gatedprune.training.distill import DistillOptions
from gatedprune.utils import check_numbers


@dataclass
class Method:
    """What every method shares: the kinds of structure it may prune, and distillation from the unpruned model."""

    name: ClassVar[str] = "method"
    # a method that scores a trained model is refused without one (resume= or model=pretrained)
    needs_trained_model: ClassVar[bool] = False
    # whether trainer.fit reads a resumed checkpoint itself (so the copy read at set-up is freed before the module
    # is built), or ``prepare`` loads what it needs of it
    loads_checkpoint_itself: ClassVar[bool] = False
    # whether the method's plans come from its gates' rule, which ``uniform_heads`` / ``uniform_ffn`` shape
    # (``gatedprune.structures.uniform``); the others refuse the options
    shapes_plans: ClassVar[bool] = False
    # whether its final table shows reference=<json> (the starting model trained on as long); the others refuse it
    shows_reference: ClassVar[bool] = False
    kinds: tuple[str, ...] = ATTENTION_KINDS
    ffn_group: int = 1  # feed-forward units gated (and removed) together, so widths stay multiples of it
    distill: DistillOptions = field(default_factory=DistillOptions)
    uniform_heads: bool = False  # every layer of an attention kind keeps the same number of heads
    uniform_ffn: bool = False  # every layer of a stack keeps the same feed-forward width
    # not an option: set by check_outputs when the fine-tune trains on the dense model's translations
    # (finetune.targets), so a gated run keeps a frozen copy of its dense weights even if nothing distils
    keeps_dense = False

    def __post_init__(self) -> None:
        check_numbers("pruning", self)
        if isinstance(self.distill, dict):  # from a config file
            self.distill = DistillOptions(**self.distill)
        self.kinds = check_kinds(self.kinds)
        if isinstance(self.ffn_group, bool) or not isinstance(self.ffn_group, int) or self.ffn_group < 1:
            raise ValueError(f"pruning.ffn_group={self.ffn_group!r}; allowed: an integer >= 1")
        for option in ("uniform_heads", "uniform_ffn"):
            value = getattr(self, option)
            if value is not False and not self.shapes_plans:
                shown = str(value).lower() if isinstance(value, bool) else repr(value)
                raise ValueError(f"pruning.{option}={shown}: pruning={self.name} does not shape its plans per layer; "
                                 "allowed: false (the gated methods, pruning=l0 and pruning=l0_budget, take it)")
        layers = [k for k in self.kinds if k in LAYER_KINDS]
        if self.distill.hidden > 0 and layers and self.distill.layer_map == "same":
            raise ValueError(f"pruning.distill.hidden={self.distill.hidden} with layer kinds {layers}: layer "
                             "distillation needs a map from teacher to kept student layers, and "
                             "pruning.distill.layer_map=same matches layer i to layer i; allowed: "
                             "pruning.distill.layer_map=nearest (CoFiPruning's learned map), or "
                             "pruning.distill.hidden=0")

    # ---- set-up checks, in the order train.py calls them --------------------------------------------------------
    def check_schedule(self, max_steps: int | None) -> None:
        """Refuse a trainer schedule the method cannot work in (called with ``trainer.max_steps``)."""

    def check_outputs(self, export, tuning, run_dir: Path):
        """Refuse what the run would ship that cannot work; returns the fine-tuning settings that apply.

        ``export``: ``ExportConfig``; ``tuning``: ``FineTuneConfig``. Shared by every method: fine-tuning with the
        teacher needs distillation settings, and a run that exports nothing fine-tunes nothing. A fine-tune on the
        dense model's translations (``finetune.targets``) has the dense weights kept (``keeps_dense``).
        """
        if tuning.distill and not self.distill.on:
            raise ValueError("finetune.distill=true needs a teacher: set pruning.distill.alpha or pruning.distill.hidden "
                             "> 0 (it is kept only then)")
        self.check_export(export)
        if export.deploy_formats() and not export.enabled:
            raise ValueError(f"export.formats={list(export.formats)} with export.enabled=false: nothing is exported "
                             f"to convert; allowed: export.formats=[hf], or export.enabled=true")
        if tuning.steps and not export.enabled:  # fine-tuning is on by default; an unexported run has no model
            print(f"note: export.enabled=false: nothing is exported, so nothing is fine-tuned (finetune.steps="
                  f"{tuning.steps} does not apply)")
            tuning = dataclasses.replace(tuning, steps=0, save_at=[])
        self.keeps_dense = bool(tuning.steps) and (tuning.targets != "labels" or tuning.distill_alpha is not None)
        return tuning

    def check_export(self, export) -> None:
        """Refuse export settings the method cannot ship with (called by ``check_outputs``)."""

    def check_checkpoint(self, path: Path, saved: dict) -> None:
        """Refuse a checkpoint (loaded as ``saved``) the method cannot start from."""

    def checkpoint_kinds(self, saved: dict) -> tuple[str, ...]:
        """The attention kinds whose gates the checkpoint must match to be resumed with this method."""
        return self.kinds

    def gating(self):
        """The ``GatedPruning`` settings the Lightning module is built with."""
        raise NotImplementedError

    def prepare(self, module, saved: dict | None) -> None:
        """Once the module exists: check the settings against its gates, load what ``run`` needs of ``saved``."""

    def check_trainer(self, trainer) -> None:
        """Refuse a trainer the method cannot run on (e.g. several processes)."""

    # ---- the run -----------------------------------------------------------------------------------------------
    def run(self, session) -> dict:
        """Run to the end (``session``: ``gatedprune.training.session.Session``); returns the run's metrics (also
        written to ``metrics.json``), or {} in a DDP process other than rank 0."""
        raise NotImplementedError
