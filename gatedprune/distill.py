"""Distillation from the dense model while the gates learn (CoFiPruning's output distillation).

The teacher is the dense model: a frozen copy of the weights the gated phase starts from (the end of the dense
phase, or the checkpoint a fork starts from). With alpha the distillation weight and T its temperature,

    task loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(p_teacher^T || p_student^T)

per target token, where p^T = softmax(logits / T); T^2 keeps the gradient scale independent of T (Hinton et al.).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gatedprune.utils import check_numbers


@dataclass(frozen=True)
class DistillOptions:
    """``pruning.distill``: alpha 0 (the default) trains on the labels alone, and no teacher is kept."""

    alpha: float = 0.0  # weight of the distillation term; 1 - alpha weighs the cross-entropy on the labels
    temperature: float = 2.0  # CoFiPruning's

    def __post_init__(self) -> None:
        check_numbers("pruning.distill", self)
        if not 0 <= self.alpha <= 1 or not self.temperature > 0:
            raise ValueError(
                f"pruning.distill alpha={self.alpha}, temperature={self.temperature}; allowed: 0 <= alpha <= 1, "
                "temperature > 0"
            )


def kl_distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x KL(teacher || student) at temperature T, averaged over target tokens (labels != -100).

    student, teacher: (B, T, V) logits; labels: (B, T).
    """
    mask = labels != -100  # (B, T)
    log_p_student = F.log_softmax(student[mask].float() / temperature, dim=-1)  # (N, V)
    log_p_teacher = F.log_softmax(teacher[mask].float() / temperature, dim=-1)  # (N, V)
    kl = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="sum")  # sum of p_t (log p_t - log p_s)
    return temperature**2 * kl / mask.sum().clamp(min=1)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that computes as the ungated model does: a fresh instance (so the gates' hooks do not
    come along), the same weights, no gradients, evaluation mode."""
    from gatedprune.surgery import fresh_model

    teacher = fresh_model(copy.deepcopy(model.config))
    teacher.load_state_dict(model.state_dict())
    teacher.to(next(model.parameters()).device).requires_grad_(False)
    return teacher.eval()
