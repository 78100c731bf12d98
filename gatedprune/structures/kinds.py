"""The kinds of structure gatedprune gates and removes, and the stack each belongs to.

One row per kind: attention heads of three kinds (as before), the intermediate units of the feed-forward blocks,
and whole layers. Names are what ``pruning.kinds`` takes and what reports print.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    stack: str  # "encoder" | "decoder"
    structure: str  # "heads" | "units" | "layer": what one gate of it switches off
    title: str  # for tables and model cards


KIND_TABLE = (
    Kind("encoder", "encoder", "heads", "encoder self-attention"),
    Kind("decoder", "decoder", "heads", "decoder self-attention"),
    Kind("cross", "decoder", "heads", "cross-attention"),
    Kind("encoder_ffn", "encoder", "units", "encoder feed-forward units"),
    Kind("decoder_ffn", "decoder", "units", "decoder feed-forward units"),
    Kind("encoder_layer", "encoder", "layer", "encoder layers"),
    Kind("decoder_layer", "decoder", "layer", "decoder layers"),
)
KINDS = {kind.name: kind for kind in KIND_TABLE}
ALL_KINDS = tuple(KINDS)
ATTENTION_KINDS = tuple(k.name for k in KIND_TABLE if k.structure == "heads")
FFN_KINDS = tuple(k.name for k in KIND_TABLE if k.structure == "units")
LAYER_KINDS = tuple(k.name for k in KIND_TABLE if k.structure == "layer")
STACKS = ("encoder", "decoder")


def check_kinds(kinds) -> tuple[str, ...]:
    """Validate a list of kinds; returns them as a tuple in canonical order."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    if not kinds:  # nothing would be gated or pruned: not an unknown kind, a missing one
        raise ValueError(f"pruning.kinds=[]; allowed: one or more of {', '.join(ALL_KINDS)}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kind(s) {unknown} in pruning.kinds; allowed: {', '.join(ALL_KINDS)}")
    return tuple(k for k in ALL_KINDS if k in kinds)


def layer_kind(stack: str) -> str:
    return f"{stack}_layer"


def ffn_kind(stack: str) -> str:
    return f"{stack}_ffn"
