"""Validation during fine-tuning: a curve, the best weights, an optional early stop, and snapshots at given steps.

Recovering a pruned model takes thousands of steps, and a fixed count either stops too soon or trains past the best
point. Every ``finetune.val_check_interval`` steps (and at the last step) the model is scored on the whole validation
split as the run's validation is (BLEU, chrF, loss); the point goes into the curve (metrics.json's
``finetune.curve``, and ``finetune/val_bleu`` etc. in the run's CSV and W&B logs at the run's step: the gated
phase's steps plus this one's). The weights of the best validation BLEU (the lower loss on a tie) are kept (a CPU
copy) and shipped at the end with their step; ``finetune.patience`` stops after that many validations in a row
without a gain.
``finetune.save_at`` writes the weights at those steps as export directories beside the shipped one, so a curve of
test BLEU can be scored afterwards on the very weights of step N (``gatedprune-evaluate``).

Everything here is saved with the fine-tune's checkpoints (``state_dict``), so a relaunch after a kill continues
the curve, the best weights and the count of validations without a gain where they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import lightning as L
import torch
from tqdm.auto import tqdm

VALIDATION_METRICS = ("bleu", "chrf", "loss")


class FineTuneValidation(L.Callback):
    """Score ``pl_module.model`` with ``score(model) -> {"bleu", "chrf", "loss", ...}`` every ``every`` steps and at
    the last; keep the best weights; stop after ``patience`` validations in a row without a gain (None: never).

    ``loggers`` receive each point at step ``offset + step``; ``save(model, step)`` is called at each step of
    ``save_at`` (after that step's validation, if any)."""

    def __init__(self, score: Callable, every: int | None, patience: int | None = None, *, loggers: Sequence = (),
                 offset: int = 0, save_at: Sequence[int] = (), save: Callable | None = None):
        self.score, self.every, self.patience = score, every, patience
        self.loggers, self.offset = list(loggers), offset
        self.save_at, self.save = set(save_at), save
        self.curve: list[dict] = []  # {"step", "bleu", "chrf", "loss"}, in order
        self.best: dict | None = None  # the curve's best point (``better``)
        self.best_state: dict | None = None  # its weights, on the CPU
        self.without_gain = 0  # validations in a row since the best
        self.stopped_at: int | None = None  # the step patience stopped at

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopped_at is not None:  # resumed from a checkpoint written where patience had stopped it
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step, last = trainer.global_step, pl_module.config.steps
        if self.every and (step % self.every == 0 or step >= last) and not self._scored(step):
            self._validate(trainer, pl_module.model, step)
        if step in self.save_at and self.save is not None:
            self.save(pl_module.model, step)

    def _scored(self, step: int) -> bool:
        return bool(self.curve) and self.curve[-1]["step"] == step

    def _validate(self, trainer: L.Trainer, model: torch.nn.Module, step: int) -> None:
        with torch.no_grad():
            result = self.score(model)  # puts the model in eval mode
        model.train()
        point = {"step": step, **{key: float(result[key]) for key in VALIDATION_METRICS}}
        self.curve.append(point)
        gained = self.best is None or better(point, self.best)
        if gained:
            self.best, self.without_gain = point, 0
            self.best_state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
        else:
            self.without_gain += 1
        tqdm.write(f"fine-tuning step {step}: validation BLEU {point['bleu']:.2f} (best {self.best['bleu']:.2f} at step "
              f"{self.best['step']})")
        for logger in self.loggers:
            logger.log_metrics({f"finetune/val_{key}": point[key] for key in VALIDATION_METRICS},
                               step=self.offset + step)
            logger.save()
        if self.patience and self.without_gain >= self.patience and step < trainer.max_steps:
            self.stopped_at = step
            trainer.should_stop = True
            tqdm.write(f"fine-tuning stopped at step {step}: {self.patience} validations without a gain "
                  f"(finetune.patience={self.patience}); the weights of step {self.best['step']} are shipped")

    def restore_best(self, model: torch.nn.Module) -> dict | None:
        """Put the best validation's weights into ``model``; returns that point (None: nothing was validated)."""
        if self.best_state is not None:
            model.load_state_dict(self.best_state)
        return self.best

    def record(self) -> dict:
        """What metrics.json's ``finetune`` says of the validations."""
        return {"curve": self.curve, "best_step": self.best["step"] if self.best else None,
                "stopped_early_at": self.stopped_at}

    def state_dict(self) -> dict:
        return {"curve": self.curve, "best": self.best, "best_state": self.best_state,
                "without_gain": self.without_gain, "stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict) -> None:
        self.curve, self.best, self.best_state = list(state["curve"]), state["best"], state["best_state"]
        self.without_gain, self.stopped_at = state["without_gain"], state["stopped_at"]


def better(point: dict, best: dict) -> bool:
    """Whether validation ``point`` beats ``best``: a higher BLEU, or the same BLEU at a lower loss (BLEU is coarse on
    a small split and ties, at 0 early on)."""
    return (point["bleu"], -point["loss"]) > (best["bleu"], -best["loss"])


def snapshot_dir(out_dir: str | Path, step: int) -> Path:
    """Where ``finetune.save_at``'s weights of ``step`` go: ``<out_dir>_step<N>`` beside the shipped model."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f"{out_dir.name}_step{step}")
