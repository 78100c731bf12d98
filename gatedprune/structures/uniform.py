"""One count per layer: ``pruning.uniform_heads`` and ``pruning.uniform_ffn``, a shape of the plan the gates keep.

Runtimes and stock classes express fewer shapes than a plan: CTranslate2 takes one head count per stack (the
decoder's covers both self- and cross-attention), the stock Hugging Face classes one FFN width per stack. With the
option on, every layer of a kind keeps the same number of structures:

    count = round(kept / L)        (0 when kept is 0, at least 1 otherwise)

where ``kept`` is what the run's rule keeps of the kind (log_alpha > 0, or the params rule) in the layers
present, or under a per-kind top-k the kind's k itself (top-k ranks gates before layers settle, so some of k may
land in a dropped layer), and L is how many layers are present (a layer dropped by its layer gate counts in neither). Each layer then
keeps its ``count`` largest log_alpha (ties: the earlier gate, as top-k). Under the params rule the count is rounded
down instead, so the plan still fits the budget (a kind that kept fewer than L then keeps none): within a kind every
structure costs the same, so ``count * L <= kept`` keeps no more parameters. ``round`` is Python's (halves to even),
as ``pruning.target_heads`` fractions are rounded. A feed-forward count is in gates, ``pruning.ffn_group`` units each.

Each kind has its own total: the option does not make decoder self- and cross-attention counts equal, so a
CTranslate2 export is unpadded only where they come out equal (a per-kind ``target_heads`` with the same share per
layer, for instance). A dropped layer's own gates are shaped too, though nothing of it ships, so the plan reads the
same in every layer.
"""

from __future__ import annotations

import torch

from gatedprune.structures.kinds import ALL_KINDS, ATTENTION_KINDS, FFN_KINDS

OPTIONS = (("uniform_heads", ATTENTION_KINDS, "attention kind"), ("uniform_ffn", FFN_KINDS, "feed-forward kind"))


def uniform_kinds(kinds, heads: bool = False, ffn: bool = False) -> tuple[str, ...]:
    """The gated ``kinds`` whose layers keep one count; ``ValueError`` for an option whose structure is not gated."""
    chosen = []
    for on, (option, structure, what) in zip((heads, ffn), OPTIONS):
        if not isinstance(on, bool):
            raise ValueError(f"pruning.{option}={on!r}; allowed: true or false")
        if not on:
            continue
        gated = [k for k in structure if k in kinds]
        if not gated:
            raise ValueError(f"pruning.{option}=true with pruning.kinds={list(kinds)}, which gates no {what}; allowed: "
                             f"false, or one of {', '.join(structure)} in pruning.kinds")
        chosen += gated
    return tuple(k for k in ALL_KINDS if k in chosen)


def per_layer_count(kept: int, layers: int, round_down: bool = False) -> int:
    """How many structures each of ``layers`` layers keeps of a kind that keeps ``kept`` in all (see the module)."""
    if kept == 0 or layers == 0:
        return 0
    return kept // layers if round_down else max(1, round(kept / layers))


def even_out(gates, per_site: list[torch.Tensor], kinds, round_down: bool = False, targets: dict | None = None,
             note: bool = True) -> list[torch.Tensor]:
    """``per_site`` keep masks (one (G,) bool tensor per site of ``gates``, layer gates settled) with every layer of
    each kind in ``kinds`` keeping ``per_layer_count`` gates, its largest log_alpha; other sites as they were.
    ``targets``: ``{kind: k}`` of a per-kind top-k, the totals those kinds keep."""
    per_site = list(per_site)
    for kind in kinds:
        sites = [i for i, k in enumerate(gates.kinds) if k == kind]
        present = [i for i in sites if gates.outer[i] is None or bool(per_site[gates.outer[i]][0])]
        kept = (targets or {}).get(kind, sum(int(per_site[i].sum()) for i in present))
        count = per_layer_count(kept, len(present), round_down)
        if note and kept and not count:
            print(f"note: the parameter budget's {kept} {kind} structures over {len(present)} layers round down to "
                  f"none per layer (uniform): the plan keeps no {kind} structure")
        for i in sites:
            ranked = torch.argsort(gates.gates[i].log_alpha.detach().cpu(), descending=True, stable=True)  # (G,)
            keep = torch.zeros_like(per_site[i])
            keep[ranked[:count]] = True
            per_site[i] = keep
    return per_site
