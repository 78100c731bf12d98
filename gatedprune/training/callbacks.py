"""Lightning callbacks of a gatedprune run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
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
