"""Lightning callbacks of a gatedprune run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException


class LastCheckpoint(L.Callback):
    """Keep ``<dirpath>/last.ckpt`` current where ModelCheckpoint's every-n-steps saving does not reach: at the end
    of training (the step metrics.json reports), and on SIGTERM (what SLURM sends before a job's time is up).

    On SIGTERM Lightning finishes the batch in flight, then raises ``SIGTERMException``; the checkpoint written
    here is the one ``resume=auto`` continues from.
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.dirpath / "last.ckpt", weights_only=False)  # the whole state, to resume

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.dirpath / "last.ckpt", weights_only=False)  # the whole state, to resume
            print(f"SIGTERM: saved {self.dirpath / 'last.ckpt'} at step {trainer.global_step}; resume with resume=auto")


class DenseCheckpoint(L.Callback):
    """Save ``<dirpath>/dense.ckpt`` after the last validation of the dense phase (at ``pruning.start_step``).

    Every gated run with a dense phase leaves one, and other runs can start there (``resume=<it>``) with their
    own pruning settings: the dense phase does not depend on them and resume is exact, so such a run ends where
    a run from scratch with its settings would. A lambda sweep then trains the dense model once.
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        start_step = pl_module.pruning.start_step
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if not fitting or start_step == 0 or trainer.global_step != start_step:
            return
        trainer.save_checkpoint(self.dirpath / "dense.ckpt", weights_only=False)
        print(f"end of the dense phase: saved {self.dirpath / 'dense.ckpt'}; gated runs can start there (resume=)")


class Converged(EarlyStopping):
    """End dense training once ``monitor`` (validation BLEU) has not improved by more than ``min_delta`` for
    ``patience`` validations in a row, and save ``<dirpath>/dense.ckpt`` where it ended: the converged start that
    comparisons fork from (``experiment=converge``). A run that reaches ``trainer.max_steps`` first saves it too,
    and says it did not converge."""

    def __init__(self, dirpath: str | Path, patience: int = 4, monitor: str = "val/bleu", min_delta: float = 0.0):
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"callbacks.converge.patience={patience!r}; allowed: a whole number >= 1 (validations)")
        super().__init__(monitor=monitor, mode="max", patience=patience, min_delta=min_delta,
                         check_on_train_epoch_end=False, verbose=False)
        self.dirpath = Path(dirpath)
        self.best_step: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking and self.wait_count == 0:  # this validation was the best so far
            self.best_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.dirpath / "dense.ckpt", weights_only=False)
        converged = self.wait_count >= self.patience
        best = float(self.best_score) if self.best_score is not None else float("nan")
        pl_module.converged = {"converged": converged, "step": trainer.global_step, "best_step": self.best_step,
                               f"best_{self.monitor.rpartition('/')[2]}": best, "patience": self.patience,
                               "min_delta": float(self.min_delta)}  # metrics.json: "converged"
        print(f"{'converged' if converged else 'not converged by trainer.max_steps'} at step {trainer.global_step}: "
              f"best {self.monitor} {best:.2f} at step {self.best_step}, none better in the {self.wait_count} "
              f"validations since; saved {self.dirpath / 'dense.ckpt'}: gated runs can start there (resume=)")

    def state_dict(self) -> dict:
        return {**super().state_dict(), "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_step = state_dict.pop("best_step", None)
        super().load_state_dict(state_dict)
