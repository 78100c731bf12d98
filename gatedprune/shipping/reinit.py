"""``finetune.init=scratch``: the exported model's weights drawn again, in place, as its family initialises a new model.

"Is pruning worth it?" asks whether the pruned model, recovered, beats the same shape trained from nothing with the
same recipe. ``model.from_scratch`` builds only even shapes; re-initialising the export keeps its exact shapes (heads
and feed-forward widths per layer, the layers kept), so the comparison is one flag. Every weight goes, embeddings
included: each module gets the family's own ``_init_weights`` (e.g. BART's normal(0, init_std), LayerNorm 1 and 0).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


def reinitialise(model: nn.Module, seed: int) -> nn.Module:
    """Draw every parameter and buffer of ``model`` (a Hugging Face ``PreTrainedModel``) again from ``seed``, with
    the family's ``_init_weights``; shapes, ties and config stay. Returns ``model``."""
    if not hasattr(model, "_init_weights"):
        raise ValueError(f"finetune.init=scratch: {type(model).__name__} has no _init_weights to draw new weights "
                         "with; allowed: a Hugging Face model (finetune.init=export otherwise)")
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        # transformers skips tensors it marked as loaded; every one is drawn again here
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            for module in model.modules():
                model._init_weights(module)
    finally:
        torch.random.set_rng_state(generator_state)  # what runs next draws as it would have
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
