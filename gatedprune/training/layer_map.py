"""Layer distillation through a layer map (CoFiPruning, Xia et al. 2022, section 3.3), for students that lose layers.

``pruning.distill.layer_map=nearest``. Per stack (encoder, decoder), with h^t_t the output of teacher layer t and
h^s_j that of student layer j (the embeddings left out), every teacher layer t = 0, 1, ... is matched, in order, to

    m(t) = argmin_{j >= m(t-1)} MSE(W h^s_j, h^t_t),        m(-1) = 0, ties to the earlier layer,

and the hidden-state term is

    MSE_hidden = sum over both stacks, sum over teacher layers t of MSE(W h^s_{m(t)}, h^t_t)

with MSE the mean squared error per element over real tokens (source positions in the encoder, target positions in
the decoder) and W the stack's learned map: a d x d linear layer with a bias, initialised to the identity (and zero),
trained with the model's weights at the model's learning rate, and never exported (it is no part of the model).
The match is chosen anew at every step, without gradient; the loss then flows through W and the matched layers.

Choices, and why:
- every teacher layer is matched (the paper's description; its code matches 4 of BERT's 12);
- j >= m(t-1), not >: a student with fewer layers than its teacher (an export that dropped some) maps several
  teacher layers to one of its layers, and the order of layers is kept;
- the candidates are all of the student's layers: under gates, a layer whose gate is closed outputs its input
  (``gatedprune.structures.layers``), so its output equals the previous layer's and the tie goes to that earlier,
  computing layer; a layer half open in a gate sample is a candidate as it computes. After export the student's
  layers are exactly its kept layers. An encoder left without layers offers its output (its embeddings): the
  model then records no hidden states for it.
"""

from __future__ import annotations

import torch
from torch import nn

LAYER_MAPS = ("same", "nearest")  # same: layer i to layer i, no map (equal layer counts); nearest: this module
STACKS = (("encoder", "encoder_hidden_states"), ("decoder", "decoder_hidden_states"))


def _identity(d: int) -> nn.Linear:
    linear = nn.Linear(d, d)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(d))
        linear.bias.zero_()
    return linear


class LayerMaps(nn.ModuleDict):
    """W per stack (``{"encoder": Linear(d, d), "decoder": Linear(d, d)}``): student hidden states to the teacher's."""

    def __init__(self, widths: dict[str, int]):
        super().__init__({stack: _identity(d) for stack, d in widths.items()})

    @classmethod
    def for_model(cls, model: nn.Module) -> LayerMaps:
        """Maps sized to ``model``'s hidden states, read off one forward of a single token (so every family's
        stacks are sized alike, whatever its config calls the width); ``model`` is left as it was."""
        device = next(model.parameters()).device
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # (B, S) = (1, 1)
        training = model.training
        with torch.no_grad():
            out = model.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids,
                               output_hidden_states=True)
        model.train(training)
        return cls({stack: getattr(out, side)[-1].shape[-1] for stack, side in STACKS})


def nearest_alignment(errors: torch.Tensor) -> list[int]:
    """m(t) of the module docstring for an error matrix (L_teacher, L_student): each teacher layer to the student
    layer of least error at or after the previous match (the first of equal ones)."""
    matched, start = [], 0
    for row in errors:  # (L_student,)
        start += int(torch.argmin(row[start:]))
        matched.append(start)
    return matched


def mapped_layer_distillation(student, teacher, maps: LayerMaps, source_mask: torch.Tensor,
                              target_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """(MSE_hidden of the module docstring, the match m per stack: ``{"encoder": [m(0), ...], "decoder": ...}``).

    student, teacher: model outputs with ``encoder_hidden_states`` and ``decoder_hidden_states`` (embeddings first,
    then one (B, S or T, d) tensor per layer); source_mask (B, S), target_mask (B, T): the real tokens.
    """
    total, alignment = 0.0, {}
    for (stack, side), mask in zip(STACKS, (source_mask, target_mask)):
        keep = mask.bool()
        states = getattr(student, side)[1:]
        if not states:  # an encoder without layers (an export keeps a decoder layer): its output is its embeddings
            states = (student.encoder_last_hidden_state,)
        mapped = [maps[stack](h[keep].float()) for h in states]  # L_student x (N, d)
        targets = [h[keep].float() for h in getattr(teacher, side)[1:]]  # L_teacher x (N, d)
        with torch.no_grad():  # the match is a choice, not a function to differentiate
            errors = torch.stack([torch.stack([(m.detach() - t).pow(2).mean() for m in mapped]) for t in targets])
        alignment[stack] = nearest_alignment(errors)  # errors: (L_teacher, L_student)
        total = total + sum((mapped[j] - t).pow(2).mean() for t, j in zip(targets, alignment[stack]))
    return total, alignment


def fit_checkpoint(checkpoint: dict, maps: LayerMaps | None, prefix: str = "layer_maps.") -> None:
    """Fit a checkpoint to whether this run has maps: a checkpoint without them (a dense.ckpt, a run that did not
    map layers) gets identity maps with fresh optimiser state; one with them, read by a run without, loses them.

    The maps' parameters close the first optimiser group (the model's: ``GatedSeq2Seq.configure_optimizers``), so
    the indices of every later parameter (the gates', a method's own) shift by their number.
    """
    state = checkpoint["state_dict"]
    saved = [key for key in state if key.startswith(prefix)]
    if maps is not None and not saved:
        fresh = {f"{prefix}{k}": v.detach().clone() for k, v in maps.state_dict().items()}
        state.update(fresh)
        _shift_first_group(checkpoint, len(fresh))
    elif maps is None and saved:
        for key in saved:
            del state[key]
        _shift_first_group(checkpoint, -len(saved))


def _shift_first_group(checkpoint: dict, change: int) -> None:
    """Grow (change > 0: new parameters, no state) or shrink (change < 0: the last ones go, with their state) the
    first optimiser group by ``change`` parameters at its end, moving the indices after it along."""
    for optimizer in checkpoint.get("optimizer_states", []):
        groups = optimizer["param_groups"]
        end = len(groups[0]["params"])  # the first group holds indices 0 .. end - 1
        gone = range(end + change, end) if change < 0 else range(0)
        optimizer["state"] = {(i + change if i >= end else i): v for i, v in optimizer["state"].items()
                              if i not in gone}
        groups[0]["params"] = list(range(end + change))
        for group in groups[1:]:
            group["params"] = [i + change for i in group["params"]]
