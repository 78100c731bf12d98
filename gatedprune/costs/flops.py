"""The FLOPs of one generate() call, per structure, by formula: what ``torch.utils.flop_counter`` counts
(``count_flops``: matrix multiplies and attention; norms, activations and biases are not counted).

For a workload of B sentences of S source tokens, beams b (R = B b decoder rows), T new tokens, model width d,
head size h, kv = key/value heads per query head (1, or less under grouped-query attention), V the vocabulary:

    encoder head     2 B S (2 + 2 kv) d h + 4 B S^2 h                  (q, k, v, o; QK^T and AV)
    decoder head     T 2 R (2 + 2 kv) d h + 4 R h T (T + 1) / 2          (step t attends to the t tokens so far)
    cross head       2 R S 2 kv d h + T 2 R 2 d h + 4 R S h T          (k, v of the source once; q, o per step)
    FFN unit         2 B S d (n + 1) in the encoder, 2 R T d (n + 1) in the decoder   (n input projections)
    layer            0 beyond its content
    base             2 R T d V                                         (the output layer, every step)

An attention module emptied of heads still runs one phantom head's attention (its QK^T and AV terms above, on zero
projections: ``surgery.pruned_modeling``): ``LinearCost.phantom``. It is not linear in the gates, so the budget's
expected cost leaves it out and the export's fill pays for it (``linear.StructureCosts.within``).
Under grouped-query attention the k/v share per query head is the dense model's: a pruned model whose kept query
heads leave a k/v head half used is priced a little low.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from gatedprune.costs.counts import kind_sites
from gatedprune.costs.linear import LinearCost
from gatedprune.costs.workload import Workload
from gatedprune.structures.kinds import KINDS


def _sdpa_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


# torch's counter knows the GPU attention kernels; on CPU, sdpa runs this one (QK^T and AV, causal mask ignored)
FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop}


def count_flops(job, model: nn.Module) -> int:
    """FLOPs of ``job(model)`` as torch's counter sees them."""
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with counter:
        job(model)
    return counter.get_total_flops()


def _attention_only(kind: str, site, w: Workload, rows: int) -> float:
    """The QK^T and AV FLOPs of one head (what a phantom head costs)."""
    B, S, T, R, h = w.batch, w.source_tokens, w.target_tokens, rows, site.head_dim
    return {"encoder": 4 * B * S * S * h, "decoder": 4 * R * h * T * (T + 1) / 2, "cross": 4 * R * S * h * T}[kind]


def _per_structure(kind: str, site, w: Workload, rows: int) -> float:
    B, S, T, R = w.batch, w.source_tokens, w.target_tokens, rows
    spec = KINDS[kind]
    if spec.structure == "heads":
        h, d = site.head_dim, site.projection("q").in_features
        kv = site.num_kv_heads / site.num_heads
        if kind == "encoder":
            return 2 * B * S * (2 + 2 * kv) * d * h + 4 * B * S * S * h
        if kind == "decoder":
            return T * 2 * R * (2 + 2 * kv) * d * h + 4 * R * h * T * (T + 1) / 2
        return 2 * R * S * 2 * kv * d * h + T * 2 * R * 2 * d * h + 4 * R * S * h * T  # cross
    if spec.structure == "units":
        tokens = B * S if spec.stack == "encoder" else R * T
        return 2 * tokens * site.projection_out().out_features * (len(site.layout.inputs) + 1)
    return 0.0  # a layer: its norms and residual are not matrix multiplies


def flops_cost(model: nn.Module, workload: Workload) -> LinearCost:
    """The FLOPs of generate() on ``workload`` as a ``LinearCost`` of ``model``'s structures."""
    rows = workload.batch * workload.num_beams
    coefficients, phantom = {}, {}
    for kind, sites in kind_sites(model).items():
        site = next((s for s in sites if s.num_units), None)  # a pruned model may have emptied some
        coefficients[kind] = _per_structure(kind, site, workload, rows) if site is not None else 0.0
        if KINDS[kind].structure == "heads" and site is not None:
            phantom[kind] = float(_attention_only(kind, site, workload, rows))
    output = model.get_output_embeddings()
    base = 2 * rows * workload.target_tokens * output.in_features * output.out_features
    return LinearCost("flops", float(base), coefficients, phantom)
