"""Distillation from the dense model (CoFiPruning's output and layer distillation), while gating and fine-tuning.

The teacher is the dense model: a frozen copy of the weights the gated phase starts from (the end of the dense
phase, or the checkpoint a fork starts from). With alpha the output-distillation weight, T its temperature and
beta the hidden-state weight,

    task loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(p_teacher^T || p_student^T) + beta * MSE_hidden

per target token, where p^T = softmax(logits / T); T^2 keeps the gradient scale independent of T (Hinton et al.).
MSE_hidden is CoFiPruning's layer distillation, by ``layer_map``:
- ``same`` (the default): for a student that keeps every layer and the model width (heads and feed-forward units go,
  layers and hidden size stay): each encoder and decoder layer's output is matched to the same layer of the teacher
  with no learned map, as the mean squared error per element over real tokens, averaged over the layers;
- ``nearest``: for a student that may lose layers (the layer kinds, or an export without some): each teacher layer
  matched to the closest student layer through a learned map, summed over teacher layers
  (``gatedprune.training.layer_map``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gatedprune.reports.scoring import cross_entropy, teacher_forced_inputs
from gatedprune.training.layer_map import LAYER_MAPS, LayerMaps, mapped_layer_distillation
from gatedprune.utils import check_numbers


@dataclass(frozen=True)
class DistillOptions:
    """``pruning.distill``: alpha 0 and hidden 0 (the default) train on the labels alone, and no teacher is kept."""

    alpha: float = 0.0  # weight of the output distillation term; 1 - alpha weighs the cross-entropy on the labels
    temperature: float = 2.0  # CoFiPruning's
    hidden: float = 0.0  # weight of the hidden-state term (beta above), added to the rest
    layer_map: str = "same"  # which student layer each teacher layer is matched to: same (i to i) or nearest

    def __post_init__(self) -> None:
        check_numbers("pruning.distill", self)
        if not 0 <= self.alpha <= 1 or not self.temperature > 0 or not self.hidden >= 0:
            raise ValueError(
                f"pruning.distill alpha={self.alpha}, temperature={self.temperature}, hidden={self.hidden}; allowed: "
                "0 <= alpha <= 1, temperature > 0, hidden >= 0"
            )
        if self.layer_map not in LAYER_MAPS:
            raise ValueError(f"pruning.distill.layer_map={self.layer_map!r}; allowed: {', '.join(LAYER_MAPS)}")

    @property
    def on(self) -> bool:
        """A teacher is needed (either term has a weight)."""
        return self.alpha > 0 or self.hidden > 0

    @property
    def maps_layers(self) -> bool:
        """The hidden-state term goes through learned layer maps (``LayerMaps``), trained beside the student."""
        return self.hidden > 0 and self.layer_map == "nearest"


def kl_distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x KL(teacher || student) at temperature T, averaged over target tokens (labels != -100).

    student, teacher: (B, T, V) logits; labels: (B, T).
    """
    mask = labels != -100  # (B, T)
    log_p_student = F.log_softmax(student[mask].float() / temperature, dim=-1)  # (N, V)
    log_p_teacher = F.log_softmax(teacher[mask].float() / temperature, dim=-1)  # (N, V)
    kl = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="sum")  # sum of p_t (log p_t - log p_s)
    return temperature**2 * kl / mask.sum().clamp(min=1)


def hidden_distillation(student, teacher, source_mask: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Mean over layers of the per-element squared error between the student's and the teacher's layer outputs,
    averaged over real tokens: encoder layers over ``source_mask`` (B, S), decoder layers over ``target_mask`` (B, T).

    student, teacher: model outputs with ``encoder_hidden_states`` and ``decoder_hidden_states`` (embeddings first,
    then one (B, S or T, d) tensor per layer); the embeddings are left out.
    """
    errors = []
    for side, mask in (("encoder_hidden_states", source_mask), ("decoder_hidden_states", target_mask)):
        keep = mask.bool()
        ours, theirs = getattr(student, side)[1:], getattr(teacher, side)[1:]
        if len(ours) != len(theirs):  # zip would silently match the first layers only
            raise ValueError(f"pruning.distill.layer_map=same matches layer i to layer i, and the student has "
                             f"{len(ours)} {side.split('_')[0]} layers, the teacher {len(theirs)}; allowed: "
                             "pruning.distill.layer_map=nearest")
        for s, t in zip(ours, theirs):  # (B, S or T, d) each
            errors.append((s[keep].float() - t[keep].float()).pow(2).mean())
    return torch.stack(errors).mean()


def distilled_loss(student: nn.Module, teacher: nn.Module, batch: dict, options: DistillOptions,
                   label_smoothing: float, maps: LayerMaps | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(CE on the labels, the task loss of the module docstring, what to log) from one student and one teacher
    forward; the teacher runs in eval mode (Lightning's train() reaches it) without gradients. ``maps``: the
    learned layer maps, needed when ``options.maps_layers``."""
    hidden = options.hidden > 0
    inputs = teacher_forced_inputs(student, batch)
    out = student(**inputs, output_hidden_states=hidden)
    ce = cross_entropy(out.logits, batch["labels"], label_smoothing)
    start = time.perf_counter()
    with torch.no_grad():
        reference = teacher.eval()(**inputs, output_hidden_states=hidden)
    logs = {"teacher_ms": 1000 * (time.perf_counter() - start)}
    loss = ce
    if options.alpha > 0:
        logs["distill"] = kl_distillation(out.logits, reference.logits, batch["labels"], options.temperature)
        loss = (1 - options.alpha) * ce + options.alpha * logs["distill"]
    if hidden:
        masks = (batch["attention_mask"], batch["labels"] != -100)
        if options.maps_layers:
            logs["distill_hidden"], _ = mapped_layer_distillation(out, reference, maps, *masks)
        else:
            logs["distill_hidden"] = hidden_distillation(out, reference, *masks)
        loss = loss + options.hidden * logs["distill_hidden"]
    return ce, loss, logs


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that computes as the ungated model does: a fresh instance (so the gates' hooks do not
    come along), the same weights, no gradients, evaluation mode."""
    from gatedprune.surgery.model_loading import fresh_model

    teacher = fresh_model(copy.deepcopy(model.config))
    teacher.load_state_dict(model.state_dict())
    teacher.to(next(model.parameters()).device).requires_grad_(False)
    return teacher.eval()
