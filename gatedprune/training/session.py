"""What a method's run is handed: the composed config and everything ``train.py`` built from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig


@dataclass
class Session:
    """One run, set up: ``Method.run(session)`` trains and ships from here."""

    cfg: DictConfig  # the whole composed config (the seed, the trainer's settings for fine-tuning)
    run_dir: Path
    trainer: L.Trainer
    module: L.LightningModule  # gatedprune.training.module.GatedSeq2Seq
    datamodule: L.LightningDataModule
    checkpoint: Path | None  # the checkpoint resumed or forked from
    tuning: object  # gatedprune.shipping.finetune.FineTuneConfig, as it applies to this run
    export: object  # gatedprune.shipping.export.ExportConfig
    reference: dict | None = None  # reference=<json>, read at set-up (gatedprune.reports.reference)

    @property
    def device(self) -> torch.device:
        """Where training runs (Lightning moves the module to the CPU when it tears down)."""
        return self.trainer.strategy.root_device
