"""Fine-tuning after pruning: the physically pruned model trains on for a few steps, without gates.

The gated model learned with gate noise; the model that is shipped never did. A short fine-tuning of the exported
model (Xia et al. 2022 fine-tune their pruned model the same way) lets the remaining heads take over from the ones
that went. It applies to whatever produced the plan, so every method can be compared with the same budget.
Optionally the dense model stays the teacher (``finetune.distill``, with the gated phase's ``pruning.distill``).
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
from torch import nn

from gatedprune.training.distill import DistillOptions, distilled_loss
from gatedprune.reports.scoring import token_cross_entropy
from gatedprune.utils import check_numbers


@dataclass
class FineTuneConfig:
    """``finetune.*`` (``conf/finetune/default.yaml`` holds the defaults); steps 0 ships the exported model as it is."""

    steps: int = 100
    lr: float = 1e-4  # constant: the model is trained already, this only lets the kept heads adjust
    distill: bool = False  # keep distilling from the dense model (needs pruning.distill.alpha or .hidden > 0)
    out_dir: str = "pruned_finetuned"

    def __post_init__(self) -> None:
        check_numbers("finetune", self)
        if self.steps < 0 or not self.lr > 0:
            raise ValueError(f"finetune.steps={self.steps}, finetune.lr={self.lr}; allowed: steps >= 0, lr > 0")


class PrunedFineTuning(L.LightningModule):
    """Cross-entropy (label smoothing as in training), optionally with the distillation term, on a plain model."""

    def __init__(self, model: nn.Module, config: FineTuneConfig, label_smoothing: float,
                 teacher: nn.Module | None = None, distill: DistillOptions | None = None):
        super().__init__()
        self.model, self.config, self.label_smoothing = model, config, label_smoothing
        self.teacher, self.distill = teacher, distill

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.teacher is not None:
            ce, loss, _ = distilled_loss(self.model, self.teacher, batch, self.distill, self.label_smoothing)
        else:
            loss = ce = token_cross_entropy(self.model, batch, self.label_smoothing)
        self.log("finetune/ce", ce, prog_bar=True, batch_size=int((batch["labels"] != -100).sum()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, weight_decay=0.0)


def finetune(model: nn.Module, datamodule, config: FineTuneConfig, trainer: L.Trainer, label_smoothing: float,
             teacher: nn.Module | None = None, distill: DistillOptions | None = None) -> nn.Module:
    """Train ``model`` (pruned, ungated) for ``config.steps`` steps on the training split; returns it in eval mode."""
    datamodule.load_state_dict({})  # from the first batch of an epoch, whatever the gated run had reached
    trainer.fit(PrunedFineTuning(model.train(), config, label_smoothing, teacher, distill), datamodule=datamodule)
    return model.eval()
