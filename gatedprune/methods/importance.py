"""Head importance by the gradient of the loss (Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than
One?").

Head h's importance is how much the loss would move if its output were scaled, token by token:
a_{h,t} = |o_{h,t} . dL/do_{h,t}|, summed over the non-pad tokens of every batch and divided by their number
(their MT code, which takes the absolute value per token; |dL/d xi_h| of the paper takes it after the sum).
Each attention module's scores are then divided by their L-p norm, so that modules whose gradients are larger do not
dominate a ranking across all of them (their code, exponent 2, the three attention kinds ranked together).

The heads' outputs are read where ``HeadGates`` gates them: the input of the output projection, (B, T, H*D),
head-major. A hook there sees the input after any gate already registered, so a closed gate's head scores 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from gatedprune.structures.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.reports.scoring import cross_entropy, teacher_forced_logits


def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    """Teacher-forced logits; decoder inputs from the batch where it has them, else built from the labels."""
    if "decoder_input_ids" in batch:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     decoder_input_ids=batch["decoder_input_ids"]).logits
    return teacher_forced_logits(model, batch)


def head_importance(model: nn.Module, batches: Iterable[dict], layer_norm_exponent: float | None = 2,
                    kinds=ATTENTION_KINDS, progress: bool = False) -> dict[str, torch.Tensor]:
    """{attention module path: importance of each head, shape (H,), on CPU}, in ``attention_sites`` order.

    ``batches``: dicts with ``input_ids``, ``attention_mask``, ``labels`` (-100 where not scored) and optionally
    ``decoder_input_ids``. Encoder self-attention counts the source tokens (``attention_mask`` 1), decoder self- and
    cross-attention the target tokens (``labels`` != -100). ``layer_norm_exponent``: p of the per-module L-p
    normalisation, None for raw scores. The model is run in eval mode (no dropout) and left as it was found: weights,
    ``.grad`` and train/eval modes.
    """
    sites = attention_sites(model, kinds)
    device = next(model.parameters()).device
    outputs: dict[str, torch.Tensor] = {}  # path -> the output projection's input of the current batch

    def capture(path: str):
        def hook(o_proj: nn.Module, args: tuple):
            (x, *rest) = args  # x: (B, T, H*D)
            if not x.requires_grad:  # nothing upstream needs a gradient (a frozen model): a leaf cuts nothing
                x = x.detach().requires_grad_()
            outputs[path] = x
            return (x, *rest)

        return hook

    scores = {s.path: torch.zeros(s.num_heads, device=device) for s in sites}  # path -> (H,)
    tokens = {"source": 0, "target": 0}
    modes = {m: m.training for m in model.modules()}
    handles = [s.projection("o").register_forward_pre_hook(capture(s.path)) for s in sites]
    try:
        model.eval()
        for batch in tqdm(batches, desc="head importance", unit="batch", disable=not progress):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            valid = {"source": batch["attention_mask"].bool(), "target": batch["labels"] != -100}  # (B, S), (B, T)
            outputs.clear()  # the last batch's tensors (and the graph they hold) go before this forward
            with torch.enable_grad():
                # a sum over tokens, not a mean: every token weighs the same whatever batch it is in
                loss = cross_entropy(_logits(model, batch), batch["labels"], reduction="sum")
                # autograd.grad, not backward: the parameters' .grad stay as they were
                grads = torch.autograd.grad(loss, [outputs[s.path] for s in sites])
            for site, grad in zip(sites, grads):
                o = outputs[site.path].detach().float().unflatten(-1, (-1, site.head_dim))  # (B, T, H, D)
                a = (o * grad.float().unflatten(-1, (-1, site.head_dim))).sum(-1).abs()  # (B, T, H)
                side = "source" if site.kind == "encoder" else "target"
                scores[site.path] += a[valid[side]].sum(0)
            tokens["source"] += int(valid["source"].sum())
            tokens["target"] += int(valid["target"].sum())
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training  # each module's own flag: train() would also reset its children
    if not any(tokens.values()):
        raise ValueError("head_importance needs at least one batch with a non-pad token")
    result = {}
    for site in sites:
        s = scores[site.path] / max(tokens["source" if site.kind == "encoder" else "target"], 1)  # (H,)
        if layer_norm_exponent is not None:
            norm = torch.linalg.vector_norm(s, ord=layer_norm_exponent)
            s = s / norm if norm > 0 else s  # a module whose heads all score 0 stays 0
        result[site.path] = s.cpu()
    return result


def rank_heads(importance: dict[str, torch.Tensor]) -> list[tuple[str, int]]:
    """Every (path, head), least important first; ties keep the dict's order (earlier module, then head, first)."""
    heads = [(path, h, float(score)) for path, s in importance.items() for h, score in enumerate(s.tolist())]
    return [(path, h) for path, h, _ in sorted(heads, key=lambda head: head[2])]
