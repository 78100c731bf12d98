"""How the run's Lightning checkpoints reach the disk: whole, or not at all.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction, which stages the file in ``$TMPDIR`` and
moves it onto the target when the run is done with it. When the run directory is on another file system (a
cluster's scratch, a mounted volume) that move is a copy, and a full disk leaves half a ``last.ckpt`` or
``dense.ckpt`` that no resume or fork can read. Here the file is written beside its target, flushed to the disk
and renamed into place, so the previous checkpoint stays whole until the new one is, and a full disk ends the
run with ``NoSpaceLeft`` naming the checkpoint (one line, exit 1).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gatedprune.utils import atomic_write_with


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves go through ``atomic_write_with``; loading and removing are Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # a remote store: Lightning's own (fsspec) saving
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_write_with(path, lambda f: torch.save(checkpoint, f))


def with_atomic_checkpoints(trainer_cfg) -> list:
    """The plugins of a trainer's config (``trainer.plugins``, instantiated), with ``AtomicCheckpointIO`` added
    unless they bring a CheckpointIO of their own: a user's plugins are kept, not replaced."""
    from hydra.utils import instantiate
    from lightning.pytorch.plugins.io import CheckpointIO

    given = trainer_cfg.get("plugins")
    plugins = instantiate(given, _convert_="all") if given else []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    return plugins if any(isinstance(p, CheckpointIO) for p in plugins) else [*plugins, AtomicCheckpointIO()]
