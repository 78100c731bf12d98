"""Lightning callbacks of a gatedprune run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class CheckpointOnSigterm(L.Callback):
    """On SIGTERM (what SLURM sends before a job's time is up) save ``<dirpath>/last.ckpt`` before exiting.

    Lightning finishes the batch in flight, then raises ``SIGTERMException``; the checkpoint written here is
    the one ``resume=auto`` continues from.
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.dirpath / "last.ckpt")
            print(f"SIGTERM: saved {self.dirpath / 'last.ckpt'} at step {trainer.global_step}; resume with resume=auto")
