"""The guard of every optimiser step, gated or fine-tuning: a step with a gradient that is not finite is not taken."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def zero_non_finite_gradients(parameters: Iterable[torch.nn.Parameter], optimizer) -> bool | None:
    """Before an optimiser step: True if every gradient is finite; False if one is not, after zeroing them all (AdamW
    leaves parameters without a gradient untouched, so the step changes nothing); None if no parameter has a
    gradient (the training step returned None for a non-finite loss and was counted there)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    if torch.isfinite(torch.stack([g.norm() for g in grads]).sum()):
        return True
    optimizer.zero_grad(set_to_none=True)
    return False
