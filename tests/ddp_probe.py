"""A callback for the DDP test: every process saves what it trained on and where its gates ended."""

from pathlib import Path

import lightning as L
import torch


class SaveRankState(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.batches: list[int] = []  # a fingerprint of each training batch this process read
        self.val_pairs: list[int] = []  # validation pairs this process translated, per validation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(hash(tuple(batch["input_ids"].flatten().tolist())))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:  # runs before the module gathers its share
        self.val_pairs.append(len(pl_module._val_hyps))

    def on_train_end(self, trainer, pl_module) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "log_alpha": torch.cat([g.log_alpha.detach() for g in pl_module.gates.gates]),
            "batches": self.batches,
            "batches_per_epoch": trainer.num_training_batches,
            "val_pairs": self.val_pairs,
            "world_size": trainer.world_size,
        }
        torch.save(state, self.out_dir / f"rank{trainer.global_rank}.pt")
