"""The guards of every optimiser step, gated or fine-tuning: a step with a non-finite loss or gradient is not taken,
and is counted; too many in a row stop the run."""

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


class BadSteps:
    """Steps skipped for a non-finite loss or gradient, in all and in a row; ``limit`` in a row stop the run
    (``optim.max_bad_steps``). ``what`` names the steps in the warnings (``step``, ``fine-tuning step``)."""

    def __init__(self, limit: int, what: str = "step"):
        self.limit, self.what = limit, what
        self.total = self.in_a_row = 0

    def good(self) -> None:
        self.in_a_row = 0

    def skip(self, step: int, why: str, stopped: str, prefix: str = "") -> None:
        """Count step ``step`` as skipped for ``why``; ``FloatingPointError`` once ``limit`` came in a row (its
        message: ``prefix``, the count, then ``stopped``: where and what is left)."""
        self.total += 1
        self.in_a_row += 1
        print(f"warning: {self.what} {step} skipped: {why} ({self.total} skipped so far)")
        if self.in_a_row >= self.limit:
            raise FloatingPointError(f"{prefix}{self.in_a_row} steps in a row had a non-finite loss or gradient "
                                     f"(optim.max_bad_steps={self.limit}); {stopped}")
